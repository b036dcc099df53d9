"""A pipeline is read from its name once: SELECTOR[+FIT][+heal[.RECIPE]] (registry.method), and
config.for_method turns what the name says into the settings every path reads."""

import pytest

from trsp_ray.common.errors import TrspError
from trsp_ray.config import registry
from trsp_ray.config.run_config import RunConfig, for_method, replace, uncompensated


@pytest.mark.parametrize("name, selector, fit, heal, recipe", [
    ("tail+cos+heal.tail", "tail", "cos", True, "tail"),
    ("angular+comp+heal.map", "angular", "comp", True, "map"),
    ("shortgpt+heal.lora", "shortgpt", None, True, "lora"),
    ("sleb+scalar", "sleb", "scalar", False, None),
    ("trsp+cos+heal", "trsp", "cos", True, None),
])
def test_a_composed_name_is_read_into_its_parts(name, selector, fit, heal, recipe):
    m = registry.method(name)
    assert (m.selector, m.fit, m.heal, m.recipe, m.stage2) == (selector, fit, heal, recipe, False)
    assert m.compensate == (fit is not None)
    assert registry.compose(selector, fit=fit, heal=heal, recipe=recipe) == name


def test_registered_names_keep_their_meaning():
    assert registry.method("trsp").stage2 and not registry.method("trsp").heal
    assert registry.method("trsp-oneshot").ranking == "round1"
    default = registry.method(registry.DEFAULT_METHOD)
    assert (default.selector, default.fit, default.heal) == ("shortgpt", "comp", True)
    # a composition that spells a registered pipeline reads the same as the registered one
    parsed = registry.method("tail+comp+heal")
    assert parsed is registry.METHODS["tail+comp+heal"]


@pytest.mark.parametrize("name, named", [
    ("shortgpt+heal+comp", "shortgpt+heal+comp"),  # the fit comes before the heal
    ("magic+heal", "magic+heal"),
    ("shortgpt+heal.bogus", "shortgpt+heal.bogus"),
    ("shortgpt+heal.", "shortgpt+heal."),
    ("shortgpt+cos+cos", "shortgpt+cos+cos"),
    ("tail+heal.map", "heal.map trains only the maps a fit folded"),
])
def test_a_bad_name_is_one_line_naming_it_and_the_grammar(name, named):
    with pytest.raises(TrspError) as e:
        registry.method(name)
    msg = str(e.value)
    assert "\n" not in msg and named in msg
    with pytest.raises(TrspError):
        RunConfig(method=name)  # the config refuses it too, before any work


def test_the_name_sets_the_fit_and_is_refused_against_a_contradicting_setting():
    scalar = for_method(RunConfig(method="shortgpt+scalar+heal"))
    assert scalar.compensation.method == "scalar"
    lstsq = for_method(RunConfig(method="shortgpt+comp+heal"))
    assert lstsq.compensation.method == "lstsq"
    plain = for_method(RunConfig(method="shortgpt+heal"))
    assert plain.compensation.method == "none"
    with pytest.raises(TrspError, match="contradicts --method shortgpt\\+scalar\\+heal"):
        for_method(replace(RunConfig(method="shortgpt+scalar+heal"), **{"compensation.method": "lstsq"}))


def test_the_uncompensated_pipeline_keeps_selector_and_heal():
    assert uncompensated("shortgpt+comp+heal") == "shortgpt+heal"
    assert uncompensated("tail+cos+heal") == "tail+heal"
    assert uncompensated("angular+scalar") == "angular"
    assert uncompensated("tail+comp+heal.map") == "tail+heal"  # heal.map has no maps left to train


def test_recipe_of_a_composition_is_what_a_plan_sizes():
    assert registry.recipe("tail+cos+heal.tail") == ("tail", "heal")
    assert registry.recipe("angular+comp") == ("angular", "none")
    with pytest.raises(TrspError, match="neither a method"):
        registry.recipe("nope")


def test_composed_heal_pipelines_after_a_worker_selector_run_on_workers():
    assert registry.on_workers("shortgpt+cos+heal") and registry.on_workers("tail+heal.tail")
    assert registry.on_workers("trsp+comp+heal.map")
    assert not registry.on_workers("angular+cos+heal")  # the workers do not choose an angular block...
    assert registry.on_workers("angular+cos+heal", drop_given=True)  # ...one process does, they heal it
    assert not registry.on_workers("shortgpt+cos")  # nothing to heal: the workers' job is the heal
    assert not registry.on_workers("sleb") and registry.on_workers("sleb+heal", drop_given=True)


def test_the_70b_job_takes_a_composed_pipeline_and_refuses_one_workers_cannot_run(capsys):
    import argparse

    from trsp_ray.run.run_args import method_type

    parse = method_type(workers=True)
    assert parse("tail+cos+heal.tail") == "tail+cos+heal.tail"
    for bad, said in (("shortgpt+cos", "not run on Ray Train workers"), ("nope+heal", "not valid")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            parse(bad)
