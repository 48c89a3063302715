"""SelZeroConfig: defaults, builders (dict, JSON/YAML file, DeepSpeed block, environment), refusals.

No process group is needed: the config is plain data validated in ``__post_init__``.
"""

import dataclasses
import json

import pytest

from selzero_plugin import ConfigError, SelZeroConfig, SelZeroError


def test_defaults_are_the_documented_ones():
    c = SelZeroConfig(params=["*.experts.*"])
    assert dataclasses.asdict(c) == {
        "params": ["*.experts.*"], "modules": [], "reduction": "mean", "normalize_over": "group",
        "missing_grad": "zero", "nonfinite": "error", "expert_dim": None, "bucket_mb": 25.0,
        "param_groups": [], "partition": "chunks", "extra_elementwise_optimizers": [],
        "extra_matrix_optimizers": [], "timeout_s": 600.0,
        "name": "selected_zero2", "broadcast": True,
        "overlap": True, "launch_modules": []}


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, SelZeroError) and issubclass(ConfigError, ValueError)


def test_config_is_frozen():
    c = SelZeroConfig(params=["x"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.reduction = "sum"


def test_params_is_required():
    with pytest.raises(TypeError):
        SelZeroConfig()  # noqa: the dataclass itself: a required keyword
    with pytest.raises(ConfigError, match="'params' is required"):
        SelZeroConfig.from_dict({"reduction": "sum"})


def test_from_dict_round_trips_through_to_dict():
    c = SelZeroConfig(params=["re:.*experts.*"], modules=["MixtralExperts"], reduction="weighted",
                      normalize_over="world", missing_grad="skip", nonfinite="skip", expert_dim=0,
                      bucket_mb=1.5, param_groups=[{"params": ["*.bias"], "weight_decay": 0.0}],
                      timeout_s=30, name="moe", broadcast=False)
    assert SelZeroConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("key, closest", [
    ("reducton", "reduction"), ("bucket_size_mb", "bucket_mb"), ("param", "params"),
    ("missing_grads", "missing_grad")])
def test_cannot_use_unknown_key_and_the_error_names_the_closest(key, closest):
    with pytest.raises(ConfigError, match=rf"unknown key '{key}' \(did you mean '{closest}'\?\)"):
        SelZeroConfig.from_dict({"params": ["x"], key: 1})


# ---- files ---------------------------------------------------------------------------------


def test_from_file_json(tmp_path):
    path = tmp_path / "selzero.json"
    path.write_text(json.dumps({"params": ["*.experts.*"], "reduction": "sum", "bucket_mb": 2}))
    assert SelZeroConfig.from_file(path) == SelZeroConfig(params=["*.experts.*"], reduction="sum",
                                                          bucket_mb=2)


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_from_file_yaml(tmp_path, suffix):
    path = tmp_path / f"selzero{suffix}"
    path.write_text("params:\n  - '*.experts.*'\n  - 're:.*\\.gate_up_proj$'\nexpert_dim: 0\n"
                    "param_groups:\n  - params: ['*.bias']\n    weight_decay: 0.0\n"
                    "broadcast: false\n")
    c = SelZeroConfig.from_file(str(path))
    assert c.params == ["*.experts.*", "re:.*\\.gate_up_proj$"]
    assert (c.expert_dim, c.broadcast) == (0, False)
    assert c.param_groups == [{"params": ["*.bias"], "weight_decay": 0.0}]


def test_from_file_reads_the_selected_zero2_block_of_a_deepspeed_config(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "selected_zero2": {"params": ["*.mlp.experts.*"], "expert_dim": 0,
                           "missing_grad": "skip"}}))
    assert SelZeroConfig.from_file(path) == SelZeroConfig(params=["*.mlp.experts.*"], expert_dim=0,
                                                          missing_grad="skip")


def test_cannot_read_unknown_key_inside_the_deepspeed_block(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"selected_zero2": {"params": ["x"], "bucketmb": 1}}))
    with pytest.raises(ConfigError, match="did you mean 'bucket_mb'"):
        SelZeroConfig.from_file(path)


def test_cannot_read_a_missing_file_or_unknown_format(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        SelZeroConfig.from_file(tmp_path / "nope.json")
    other = tmp_path / "selzero.toml"
    other.write_text("params = ['x']")
    with pytest.raises(ConfigError, match=r"\.json, \.yaml or \.yml"):
        SelZeroConfig.from_file(other)


# ---- environment ---------------------------------------------------------------------------


def test_from_env_fields():
    c = SelZeroConfig.from_env({"SELZERO_PARAMS": '["*.experts.*", "re:.*router.*"]',
                                "SELZERO_BUCKET_MB": "12.5", "SELZERO_EXPERT_DIM": "0",
                                "SELZERO_BROADCAST": "false", "SELZERO_REDUCTION": "weighted",
                                "PATH": "/bin", "OTHER_SELZERO_X": "ignored"})
    assert c == SelZeroConfig(params=["*.experts.*", "re:.*router.*"], bucket_mb=12.5, expert_dim=0,
                              broadcast=False, reduction="weighted")


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("SELZERO_PARAMS", '["experts.*"]')
    monkeypatch.setenv("SELZERO_TIMEOUT_S", "42")
    assert SelZeroConfig.from_env() == SelZeroConfig(params=["experts.*"], timeout_s=42.0)


def test_from_env_config_file_with_overrides(tmp_path):
    path = tmp_path / "selzero.yaml"
    path.write_text("params: ['*.experts.*']\nreduction: sum\nbucket_mb: 4\nname: moe\n")
    c = SelZeroConfig.from_env({"SELZERO_CONFIG": str(path), "SELZERO_BUCKET_MB": "8",
                                "SELZERO_MISSING_GRAD": "skip"})
    assert c == SelZeroConfig(params=["*.experts.*"], reduction="sum", bucket_mb=8.0, name="moe",
                              missing_grad="skip")


def test_an_unknown_selzero_variable_warns_naming_the_closest_and_is_ignored():
    """Another tool's SELZERO_* variable must not abort a launch (issue 21 item 14); a typo of
    a field is named in the warning."""
    with pytest.warns(UserWarning, match=r"SELZERO_BUCKETMB.*did you mean 'SELZERO_BUCKET_MB'"):
        c = SelZeroConfig.from_env({"SELZERO_PARAMS": '["x"]', "SELZERO_BUCKETMB": "1",
                                    "SELZERO_CLUSTER_TAG": "blue"})
    assert c == SelZeroConfig(params=["x"])


def test_selzeros_own_variables_that_are_not_fields_pass_without_a_warning():
    """SELZERO_LOG_LEVEL and SELZERO_GLOO_REDUCE are read elsewhere (the logger, the gloo
    reduction): no warning at a launch that sets them."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = SelZeroConfig.from_env({"SELZERO_PARAMS": '["x"]', "SELZERO_LOG_LEVEL": "INFO",
                                    "SELZERO_GLOO_REDUCE": "all_reduce"})
    assert c == SelZeroConfig(params=["x"])


@pytest.mark.parametrize("name, text, expected", [
    ("bad.yaml", "params: [*.experts.*\nbucket_mb: 3\n", "is not valid YAML at line 1"),
    ("bad.json", '{"params": ["x"],}', "is not valid JSON"),
])
def test_a_malformed_file_is_a_config_error_naming_the_file(tmp_path, name, text, expected):
    """Not PyYAML's traceback naming `<unicode string>` (issue 21 item 15)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=expected) as info:
        SelZeroConfig.from_file(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("var, raw, needle", [
    ("SELZERO_PARAMS", "*.experts.*", "expected a JSON list"),
    ("SELZERO_BUCKET_MB", "big", "expected a number"),
    ("SELZERO_EXPERT_DIM", "first", "expected an? int"),
    ("SELZERO_BROADCAST", "maybe", "expected true or false"),
])
def test_cannot_parse_a_malformed_variable(var, raw, needle):
    env = {"SELZERO_PARAMS": '["x"]', var: raw}
    with pytest.raises(ConfigError, match=f"{var}.*{needle}"):
        SelZeroConfig.from_env(env)


def test_cannot_build_from_an_empty_environment():
    with pytest.raises(ConfigError, match="SELZERO_PARAMS"):
        SelZeroConfig.from_env({"HOME": "/root"})


# ---- invalid values ------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, needle", [
    ("reduction", "weigthed", "did you mean 'weighted'"),
    ("normalize_over", "global", "'group', 'world'"),
    ("missing_grad", "raise", "'zero', 'error', 'skip'"),
    ("nonfinite", "ignore", "'error', 'skip'"),
    ("bucket_mb", -1.0, "positive"),
    ("bucket_mb", 0, "positive"),
    ("bucket_mb", float("nan"), "positive"),
    ("bucket_mb", True, "positive"),
    ("timeout_s", 0, "positive"),
    ("expert_dim", 1, "only 0"),
    ("expert_dim", True, "only 0"),
    ("params", ["re:experts.[0-"], "invalid regular expression"),
    ("params", "*.experts.*", "list of non-empty strings"),
    ("params", [""], "list of non-empty strings"),
    ("modules", ["Expert", 3], "list of non-empty strings"),
    ("param_groups", [{"weight_decay": 0.0}], "'params' list"),
    ("param_groups", [{"params": ["re:("]}], "invalid regular expression"),
    ("name", "a/b", "without '/'"),
    ("broadcast", "yes", "true or false"),
    ("overlap", 1, "true or false"),
    ("launch_modules", "layers.*", "list of non-empty strings"),
    ("normalize_over", "everyone", "'group', 'world'"),
])
def test_cannot_build_with_an_invalid_value(field, value, needle):
    kwargs = {"params": ["experts.*"], field: value}
    with pytest.raises(ConfigError) as info:
        SelZeroConfig(**kwargs)
    assert needle in str(info.value) and field.split("_")[0] in str(info.value)
    with pytest.raises(ValueError):  # the same through from_dict, as a ValueError
        SelZeroConfig.from_dict(kwargs)
