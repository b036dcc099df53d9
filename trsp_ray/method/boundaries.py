"""The block boundaries a drop set leaves, and a forward pass cut short after the last layer it needs.

Shared by both compensation forms (trsp_ray/method/compensation.py, trsp_ray/method/compensation_scalar.py): each
repairs the boundary a_k-1 -> b_k+1 of every maximal run [a_k..b_k] of removed layers, and reads the
dense stream with forward hooks that stop the pass once the deepest layer they need has run
(`stream_blocks` hands each block its rows as soon as its last layer has run, so a pass holds one
block's rows at a time).
"""

from __future__ import annotations

from trsp_ray.common.errors import TrspError


def blocks(drop, num_layers: int) -> list[tuple[int, int]]:
    """Maximal contiguous runs of dropped layers as (first, last) original indices, ascending."""
    out: list[tuple[int, int]] = []
    for i in sorted(int(j) for j in drop):
        if not 0 <= i < num_layers:
            raise TrspError(f"drop set {sorted(drop)} is not valid for a {num_layers}-layer model")
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def fold_layers(spans) -> list[int]:
    """The original index of the kept layer each block's map is folded into: the layer before it
    (a - 1 for block (a, b); what compensation.compensate folds into and reports as "blocks")."""
    return [a - 1 for a, _ in spans]


class Stop(Exception):
    """Raised by a hook once the last layer a pass needs has run: the rest is not computed."""


def hidden(output):
    """The hidden-state tensor of a module's output (decoder layers may return a tuple)."""
    return output[0] if isinstance(output, tuple) else output


def forward_pass(model, batch) -> None:
    """One no-grad pass of token ids `batch` [B, S] through `model` for its hooks: only the last
    position's logits are computed (the fit reads decoder layers; a whole vocabulary's logits over
    every token would be the pass's largest tensor at a 128k vocabulary), the same modules run, so
    a ZeRO-3 forward makes the same gathers on every rank."""
    model(input_ids=batch.to(next(model.parameters()).device), use_cache=False, logits_to_keep=1)



def hooked_pass(model, batch, handles) -> None:
    """forward_pass with the hooks of `handles` in place: a hook's Stop ends it early, and the hooks
    are removed whatever happens (every pass of the fit and its streams goes through here)."""
    try:
        forward_pass(model, batch)
    except Stop:
        pass
    finally:
        for h in handles:
            h.remove()

def layer_outputs(model, layers: list[int], windows, *, stop: bool = True) -> list[list]:
    """Per decoder layer of `layers`, per batch of token ids of `windows`: the stream that layer leaves, [n, d] in
    the stream's dtype on the host, from one pass a batch that stops after the deepest (a merge's dense targets;
    `stop=False`: whole passes, as ZeRO-3 ranks run them)."""
    from trsp_ray.models import families

    decoder = families.decoder_layers(model)
    got: list[list] = [[] for _ in layers]

    def keeper(k):
        return lambda _m, _i, out: got[k].append(hidden(out).reshape(-1, hidden(out).shape[-1]).cpu())

    def halt(*_):
        raise Stop

    for batch in windows:
        handles = [decoder[i].register_forward_hook(keeper(k)) for k, i in enumerate(layers)]
        if stop:
            handles.append(decoder[max(layers)].register_forward_hook(halt))
        hooked_pass(model, batch, handles)
    return got


def stream_blocks(model, batch, spans, *, on_block, stop: bool, mlp_output=None) -> None:
    """One pass of `batch` through `model` that hands every block (a, b) of `spans` its rows [n, d]
    as soon as layer b has run: on_block(span, out, m, target) with layer a-1's output, its MLP
    output and layer b's output. Layer a-1's two rows are the only ones held across layers, until
    the block is summed (compensation_plan counts them); `stop`: the pass ends after the last block."""
    from trsp_ray.models import families

    mlp_output = mlp_output or (lambda layer, m: families.map_output(layer, m)[0])
    layers = families.decoder_layers(model)
    held: dict = {}
    last = max(b for _, b in spans)

    def keep(key):
        def hook(_module, _inputs, output):
            h = hidden(output)
            held[key] = h.reshape(-1, h.shape[-1])
        return hook

    def finish(span):
        def hook(_module, _inputs, output):
            h = hidden(output)
            a = span[0]
            on_block(span, held.pop((a - 1, "out")), held.pop((a - 1, "mlp")), h.reshape(-1, h.shape[-1]))
            if stop and span[1] == last:
                raise Stop
        return hook

    handles = []
    try:
        for a, b in spans:
            handles.append(mlp_output(layers[a - 1], model).register_forward_hook(keep((a - 1, "mlp"))))
            handles.append(layers[a - 1].register_forward_hook(keep((a - 1, "out"))))
            handles.append(layers[b].register_forward_hook(finish((a, b))))
    except BaseException:
        for h in handles:
            h.remove()
        raise
    try:
        hooked_pass(model, batch, handles)
    finally:
        held.clear()
