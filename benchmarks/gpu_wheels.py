"""The wheels and assets the GPU check needs on a GPU node that can download nothing (DEVELOPERS.md).

On a machine with network, from the checkout's root:

    python benchmarks/gpu_wheels.py build --python-version 3.12 [--part-mb MB]   # assets + gather + pack, into .gpu/
    python benchmarks/gpu_wheels.py gather --python-version 3.12 --dest DIR [--platform TAG ...]
    python benchmarks/gpu_wheels.py assets --dest DIR

On the GPU node (no network), after the parts were copied there (all at once, or one at a time):

    python benchmarks/gpu_wheels.py install --from .gpu/part1 [--from .gpu/part2 ...] \
        --stage /tmp/stage --target /tmp/stage/site

`gather` runs `pip download --only-binary=:all: --no-deps --python-version X --platform Y` once per
requirement (WANTED: ray, deepspeed, transformers and what they import that a bare torch + transformers GPU
image lacks), at the version pyproject.toml pins, else the one installed here (the project's tested set),
else FALLBACK; a wheel already in the folder or in an `--extra-wheels` folder is not downloaded again
(DeepSpeed ships no wheel: build one, the error says how). It writes wheels.json (name, version, pinned,
sha256). `pack` puts the wheels in part folders: one holding every wheel, or with `--part-mb` as many as
needed of at most that size each (for a transfer that limits a file or a copy), a wheel too big for what
is left split across parts. `install` copies the parts given into the stage folder, joins a wheel whose
pieces have all arrived (sha256 checked), and installs
with `pip install --no-index --find-links STAGE --no-deps --target TARGET` every complete wheel the
machine lacks: a project pin unless that version is there, another unless that version or a newer one is.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WANTED = ("transformers", "ray", "deepspeed", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
          "typing-extensions", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "tensorboardX",
          "hjson", "msgpack", "py-cpuinfo", "ninja")
FALLBACK = {"pydantic": "2.14.4", "pydantic-core": "2.50.5", "annotated-types": "0.8.0", "typing-inspection": "0.4.5",
            "typing-extensions": "4.16.0", "jsonschema": "4.26.0", "jsonschema-specifications": "2025.9.1",
            "referencing": "0.37.0", "rpds-py": "2026.9.1", "tensorboardX": "2.6.5", "hjson": "3.1.0",
            "msgpack": "1.2.4", "py-cpuinfo": "9.0.0", "ninja": "1.13.2"}  # the versions the first GPU run used
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
MANIFEST = "wheels.json"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(pyproject: Path = REPO / "pyproject.toml") -> dict[str, str]:
    """{normalized name: version} of the exact pins (name==version, extras allowed) in pyproject.toml."""
    text = pyproject.read_text(encoding="utf-8")
    return {norm(m[1]): m[2] for m in re.finditer(r'"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^\]]*\])?\s*==\s*([^";\s]+)', text)}


def requirements(names=WANTED, pinned: dict[str, str] | None = None) -> list[dict]:
    """[{name, version, pinned}]: the pyproject pin, else the version installed here, else FALLBACK."""
    pinned = pins() if pinned is None else pinned
    out = []
    for name in names:
        version, is_pin = pinned.get(norm(name)), norm(name) in pinned
        if version is None:
            try:
                version = md.version(name)
            except md.PackageNotFoundError:
                version = FALLBACK[name]
        out.append({"name": name, "version": version, "pinned": is_pin})
    return out


def download_command(req: dict, *, python_version: str, platforms, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps", "--implementation", "cp",
            "--python-version", python_version, *[a for p in platforms for a in ("--platform", p)],
            "-d", str(dest), f"{req['name']}=={req['version']}"]


def find_wheel(folders, name: str, version: str, python_version: str) -> Path | None:
    """A wheel of name==version for that Python (or any Python: py3-none-any) in one of the folders."""
    stem, tag = f"{norm(name).replace('-', '_')}-{version}-", f"cp{python_version.replace('.', '')}"
    for folder in folders:
        for path in sorted(Path(folder).glob("*.whl")) if Path(folder).is_dir() else []:
            low = path.name.lower()
            if low.startswith(stem.lower()) and (low.endswith("-none-any.whl") or f"-{tag}-" in low):
                return path
    return None


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def gather(*, python_version: str, platforms, dest: Path, extra: list[Path],
           reqs: list[dict] | None = None) -> list[dict]:
    dest.mkdir(parents=True, exist_ok=True)
    entries = []
    for req in reqs or requirements():
        found = find_wheel([dest, *extra], req["name"], req["version"], python_version)
        if found is None:
            cmd = download_command(req, python_version=python_version, platforms=platforms, dest=dest)
            done = subprocess.run(cmd, capture_output=True, text=True)
            found = find_wheel([dest], req["name"], req["version"], python_version)
            if done.returncode != 0 or found is None:
                hint = (f"; DeepSpeed ships no wheel: in a Python {python_version} environment with torch run "
                        f"DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation -w DIR deepspeed=={req['version']}"
                        f" and pass --extra-wheels DIR" if req["name"] == "deepspeed" else "")
                tail = (done.stderr.strip().splitlines() or ["?"])[-1]
                raise SystemExit(f"gpu_wheels: no {req['name']}=={req['version']} wheel for Python {python_version}: "
                                 f"{tail}{hint}")
        if found.parent != dest:
            shutil.copyfile(found, dest / found.name)
        entries.append({**req, "file": found.name, "bytes": found.stat().st_size, "sha256": sha256(dest / found.name)})
        print(f"  {req['name']:<26} {req['version']:<10} {'pin' if req['pinned'] else '   '}  {found.name}")
    (dest / MANIFEST).write_text(json.dumps({"python": python_version, "wheels": entries}, indent=1))
    return entries


def pack(source: Path, dest: Path, *, limit: int | None = None) -> list[Path]:
    """The wheels of `source` in part folders dest/part1, part2, ...: one holding every wheel, or with
    `limit` (bytes) as many as needed of at most `limit` each, a wheel that does not fit in what is left
    cut (FILE.pieceKofN): transformers first (the one-process parts need it), then by size."""
    manifest = json.loads((source / MANIFEST).read_text())
    order = sorted(manifest["wheels"], key=lambda w: (w["name"] != "transformers", w["bytes"]))
    for old in dest.glob("part*"):
        shutil.rmtree(old)
    parts: list[Path] = []

    def next_part() -> int:
        folder = dest / f"part{len(parts) + 1}"
        folder.mkdir(parents=True)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
        parts.append(folder)
        return limit or sum(w["bytes"] for w in order)  # the room it has

    room = next_part()
    for wheel in order:
        data, offset, pieces = (source / wheel["file"]).read_bytes(), 0, []
        while offset < len(data):
            if room == 0:
                room = next_part()
            take = min(room, len(data) - offset)
            pieces.append((parts[-1], data[offset:offset + take]))
            offset, room = offset + take, room - take
        for k, (folder, chunk) in enumerate(pieces, start=1):
            name = wheel["file"] if len(pieces) == 1 else f"{wheel['file']}.piece{k}of{len(pieces)}"
            (folder / name).write_bytes(chunk)
    return parts


def install(sources: list[Path], *, stage: Path, target: Path) -> int:
    complete, waiting = stage_wheels(sources, stage=stage)
    for line in waiting:
        print(f"  waiting for the rest of {line}")
    ready = []
    for wheel in complete:
        have = installed_version(wheel["name"], target)
        if needed(wheel, have):
            ready.append(wheel)
        else:
            print(f"  {wheel['name']} {wheel['version']}: have {have}")
    if not ready:
        return 0
    specs = [f"{w['name']}=={w['version']}" for w in ready]
    print(f"  installing into {target}: {' '.join(specs)}", flush=True)
    return subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(stage),
                           "--no-deps", "--no-compile", "--upgrade", "--target", str(target), *specs]).returncode


def stage_wheels(sources: list[Path], *, stage: Path) -> tuple[list[dict], list[str]]:
    """(complete wheels, wheels still waiting for pieces): the parts' files copied into the stage folder,
    each wheel whose pieces have all arrived joined and checked against its sha256."""
    stage.mkdir(parents=True, exist_ok=True)
    for folder in sources:
        for path in folder.iterdir():
            if path.is_file():  # a file an earlier install staged is replaced (copied files may be read-only)
                (stage / path.name).unlink(missing_ok=True)
                shutil.copyfile(path, stage / path.name)
    manifest = json.loads((stage / MANIFEST).read_text())
    complete, waiting = [], []
    for wheel in manifest["wheels"]:
        path = stage / wheel["file"]
        pieces = sorted(stage.glob(wheel["file"] + ".piece*of*"), key=piece_number)
        if not path.exists() and pieces and len(pieces) == int(pieces[0].name.rsplit("of", 1)[1]):
            with open(path, "wb") as out:
                for piece in pieces:
                    out.write(piece.read_bytes())
        if not path.exists():
            waiting.append(f"{wheel['file']} ({len(pieces)} piece(s) here)")
            continue
        if sha256(path) != wheel["sha256"]:
            path.unlink()
            raise SystemExit(f"gpu_wheels: {wheel['file']} does not match its sha256: pieces from another build?")
        for piece in pieces:
            piece.unlink()
        complete.append(wheel)
    return complete, waiting


def piece_number(path: Path) -> int:
    """K of FILE.pieceKofN."""
    return int(path.name.rsplit(".piece", 1)[1].split("of")[0])


def installed_version(name: str, target: Path) -> str | None:
    """The version of `name` in the target folder, else in this Python's own paths."""
    for path in ([str(target)], None):
        found = [d.version for d in md.distributions(**({"path": path} if path else {}))
                 if norm(d.metadata["Name"] or "") == norm(name)]
        if found:
            return found[0]
    return None


def needed(wheel: dict, have: str | None) -> bool:
    if have is None:
        return True
    if wheel["pinned"]:
        return have != wheel["version"]
    from packaging.version import Version

    return Version(have) < Version(wheel["version"])


def assets(dest: Path, *, calib_chars: int = 800_000, eval_chars: int = 120_000) -> None:
    """SmolLM2's tokenizer (and config, as smollm2_config.json) and the wiki domain's texts, cut."""
    sys.path.insert(0, str(REPO))
    from trsp_ray.data.assets import smollm2_dir
    from trsp_ray.data.domains import texts

    model, tok = smollm2_dir(), dest / "tokenizer"
    shutil.rmtree(dest, ignore_errors=True)
    tok.mkdir(parents=True)
    (dest / "text").mkdir()
    for path in model.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(path, tok / path.name)
    shutil.copy(model / "config.json", tok / "smollm2_config.json")
    calib, held = texts("wiki")
    (dest / "text" / "calib.txt").write_text(calib[:calib_chars], encoding="utf-8")
    (dest / "text" / "eval.txt").write_text(held[:eval_chars], encoding="utf-8")


def build(args) -> int:
    dest = args.dest
    exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=REPO, capture_output=True,
                                  text=True, check=True).stdout.strip())
    exclude = exclude if exclude.is_absolute() else REPO / exclude
    rel = f"/{dest.resolve().relative_to(REPO)}/" if dest.resolve().is_relative_to(REPO) else None
    if rel and rel not in (exclude.read_text().splitlines() if exclude.exists() else []):
        with open(exclude, "a") as f:
            f.write(rel + "\n")  # ignored: a bundle is not part of the checkout
    assets(dest / "assets")
    wheels = dest / "dl" / f"cp{args.python_version.replace('.', '')}"
    gather(python_version=args.python_version, platforms=args.platform or PLATFORMS, dest=wheels,
           extra=args.extra_wheels)
    parts = pack(wheels, dest, limit=int(args.part_mb * 1e6) if args.part_mb else None)
    assets_mb = sum(p.stat().st_size for p in (dest / "assets").rglob("*") if p.is_file()) / 1e6
    print(f"  {dest / 'assets'}: {assets_mb:.1f} MB (the tokenizer and texts)")
    for folder in parts:
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        print(f"  {folder}: {size / 1e6:.1f} MB of wheels")
    print("copy the checkout, the assets and the parts to the GPU node; there: gpu_wheels.py install "
          + " ".join(f"--from {p.relative_to(dest.parent) if dest.parent in p.parents else p}" for p in parts))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("build", "gather"):
        s = sub.add_parser(name)
        s.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
        s.add_argument("--platform", action="append", default=[], help=f"wheel platform tags (default {PLATFORMS})")
        s.add_argument("--extra-wheels", type=Path, action="append", default=[],
                       help="a folder of wheels built elsewhere (DeepSpeed publishes none)")
        s.add_argument("--dest", type=Path, default=REPO / ".gpu" if name == "build" else None,
                       required=name == "gather")
    sub.choices["build"].add_argument("--part-mb", type=float, default=None,
                                      help="split the wheels into parts of at most this many MB (default: one part)")
    a = sub.add_parser("assets")
    a.add_argument("--dest", type=Path, required=True)
    i = sub.add_parser("install")
    i.add_argument("--from", dest="sources", type=Path, action="append", required=True)
    i.add_argument("--stage", type=Path, default=Path("/tmp/stage"))
    i.add_argument("--target", type=Path, default=Path("/tmp/stage/site"))
    args = p.parse_args(argv)
    if args.cmd == "build":
        return build(args)
    if args.cmd == "gather":
        gather(python_version=args.python_version, platforms=args.platform or PLATFORMS, dest=args.dest,
               extra=args.extra_wheels)
        return 0
    if args.cmd == "assets":
        assets(args.dest)
        return 0
    return install(args.sources, stage=args.stage, target=args.target)


if __name__ == "__main__":
    sys.exit(main())
