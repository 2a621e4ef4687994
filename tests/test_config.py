"""Config loading: every shipped YAML, overrides, `base:` inheritance and error messages."""

import re
from pathlib import Path

import pytest

from lwm.config import Config, ConfigError, ModelConfig, config_to_yaml, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEBUG = CONFIGS / "debug.yaml"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_loads(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, Config)
    assert config.model.vision_vocab_size == 8448
    # the command that shows it, with the devices its mesh needs where that is more than one
    first = path.read_text().splitlines()[0]
    assert re.fullmatch(rf"# lwm info --config configs/{path.name}( --cpu-devices \d+)?", first), (
        first
    )


def test_context_stages_inherit_7b() -> None:
    stages = {
        "7b_32k": (1e6, 32768),
        "7b_128k": (1e7, 131072),
        "7b_256k": (1e7, 262144),
        "7b_512k": (2.5e7, 524288),
        "7b_1m": (5e7, 1048576),
    }
    base = load_config(CONFIGS / "7b.yaml").model
    for name, (theta, seq) in stages.items():
        model = load_config(CONFIGS / f"{name}.yaml").model
        assert (model.rope_theta, model.max_seq_len) == (theta, seq)
        rest = {"rope_theta", "max_seq_len"}
        assert model.model_dump(exclude=rest) == base.model_dump(exclude=rest)
    assert base.rms_norm_eps == 1e-6 and base.attention == "ring" and base.dtype == "bfloat16"


def test_overrides() -> None:
    config = load_config(
        DEBUG,
        ["model.num_layers=4", "mesh.shape=1,-1,4,1", "model.rope_theta=1e6", "seed=7"],
    )
    assert config.model.num_layers == 4
    assert config.mesh.shape == "1,-1,4,1"
    assert config.model.rope_theta == 1e6
    assert config.seed == 7
    # A string field keeps the raw text even when it would parse as a number.
    assert load_config(DEBUG, ["mesh.shape=8"]).mesh.shape == "8"
    assert load_config(DEBUG, ["model.head_dim=null"]).model.head_dim == 16


def test_head_dim_defaults_and_validation() -> None:
    model = load_config(DEBUG).model
    assert model.head_dim == 64 // 4 and model.num_kv_groups == 2
    assert model.q_size == 64 and model.kv_size == 32
    with pytest.raises(
        ConfigError, match=r"num_heads \(4\) must be divisible by num_kv_heads \(3\)"
    ):
        load_config(DEBUG, ["model.num_kv_heads=3"])
    with pytest.raises(ConfigError, match="hidden_size"):
        load_config(DEBUG, ["model.num_heads=3", "model.num_kv_heads=1"])
    assert load_config(DEBUG, ["model.num_heads=3", "model.num_kv_heads=1", "model.head_dim=20"])


def test_vision_window_needs_a_grid_wider_than_it() -> None:
    grid = "model.vision_grid=[2,3]"
    assert load_config(DEBUG, [grid, "model.vision_window=2"]).model.vision_window == 2
    with pytest.raises(ConfigError, match="vision_window needs vision_grid"):
        load_config(DEBUG, ["model.vision_window=1"])
    with pytest.raises(
        ConfigError, match=r"vision_window \(3\) must be below the grid's 3 columns"
    ):
        load_config(DEBUG, [grid, "model.vision_window=3"])


def test_muon_without_weight_decay_and_a_named_optimizer() -> None:
    assert load_config(DEBUG, ["train.optimizer=muon"]).train.optimizer == "muon"
    with pytest.raises(
        ConfigError, match="weight_decay is not supported with train.optimizer=muon"
    ):
        load_config(DEBUG, ["train.optimizer=muon", "train.weight_decay=0.1"])
    with pytest.raises(ConfigError, match=r"'train.optimizer': 'sgd' \(expected one of 'adamw'"):
        load_config(DEBUG, ["train.optimizer=sgd"])


def test_qa_turns_are_named_and_isolated_ones_need_a_dataset() -> None:
    cfg = load_config(DEBUG, ["data.qa_turns=isolated", "data.source=/some/tokens"])
    assert cfg.data.qa_turns == "isolated"
    with pytest.raises(ConfigError, match="qa_turns isolated needs a dataset written by"):
        load_config(DEBUG, ["data.qa_turns=isolated"])  # the synthetic source
    with pytest.raises(ConfigError, match=r"'data.qa_turns': 'loose' \(expected one of 'chained'"):
        load_config(DEBUG, ["data.qa_turns=loose"])
    cfg = load_config(DEBUG, ["data.qa_turns=mixed", "data.source=/t", "data.qa_chained_share=0.5"])
    assert (cfg.data.qa_turns, cfg.data.qa_chained_share) == ("mixed", 0.5)
    with pytest.raises(ConfigError, match="qa_turns mixed needs a dataset written by"):
        load_config(DEBUG, ["data.qa_turns=mixed"])
    with pytest.raises(ConfigError, match="'data.qa_chained_share'"):
        load_config(DEBUG, ["data.qa_turns=mixed", "data.source=/t", "data.qa_chained_share=2"])


def test_unknown_key_names_key_and_valid_keys() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(DEBUG, ["model.not_a_field=1"])
    message = str(info.value)
    valid = ", ".join(sorted(ModelConfig.model_fields))
    assert message == (f"unknown config key 'model.not_a_field'; valid keys in 'model': {valid}")
    top = ", ".join(sorted(Config.model_fields))
    with pytest.raises(ConfigError) as info:
        load_config(DEBUG, ["trian.steps=3"])
    assert str(info.value) == f"unknown config key 'trian'; valid keys at the top level: {top}"
    assert "train" in top


def test_wrong_type_names_key_value_and_type() -> None:
    with pytest.raises(ConfigError, match=r"'model.num_layers': 'abc' \(expected int\)"):
        load_config(DEBUG, ["model.num_layers=abc"])
    with pytest.raises(ConfigError, match=r"'model.attention': 'flash' \(expected one of 'dense'"):
        load_config(DEBUG, ["model.attention=flash"])
    with pytest.raises(ConfigError, match="'model.num_layers'.*greater than 0"):
        load_config(DEBUG, ["model.num_layers=0"])


def test_malformed_override_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="malformed override 'model.num_layers'"):
        load_config(DEBUG, ["model.num_layers"])
    with pytest.raises(ConfigError, match="malformed override 'model.=3'"):
        load_config(DEBUG, ["model.=3"])
    with pytest.raises(ConfigError, match="'model.num_layers' is a value, not a section"):
        load_config(DEBUG, ["model.num_layers.x=1"])
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"config file '{missing}' not found"):
        load_config(missing)


def test_missing_required_key(tmp_path: Path) -> None:
    path = tmp_path / "partial.yaml"
    path.write_text("model:\n  hidden_size: 8\n")
    with pytest.raises(ConfigError, match="missing required config key 'model.num_layers'"):
        load_config(path)


def test_base_inheritance_deep_merges(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    child = tmp_path / "sub" / "child.yaml"
    child.write_text(f"base: {DEBUG}\nmodel:\n  num_layers: 3\nmesh:\n  shape: [1, -1, 2, 1]\n")
    grandchild = tmp_path / "grandchild.yaml"
    grandchild.write_text("base: sub/child.yaml\nmodel:\n  hidden_size: 128\n")
    config = load_config(grandchild, ["model.block_q=16"])
    parent = load_config(DEBUG)
    assert config.model.num_layers == 3 and config.model.hidden_size == 128
    assert config.model.block_q == 16
    assert config.model.num_heads == parent.model.num_heads
    assert config.mesh.shape == "1,-1,2,1"

    loop = tmp_path / "loop.yaml"
    loop.write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="circular 'base' chain"):
        load_config(loop)


def test_bad_yaml_names_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=f"config file '{path}' is not valid YAML"):
        load_config(path)
    path.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must contain a mapping"):
        load_config(path)


def test_yaml_round_trip(tmp_path: Path) -> None:
    config = load_config(CONFIGS / "7b_1m.yaml")
    path = tmp_path / "dumped.yaml"
    path.write_text(config_to_yaml(config))
    assert load_config(path) == config


def test_vision_vocabulary_must_hold_the_markers() -> None:
    from data.tokens import EOV_ID

    with pytest.raises(ConfigError, match=f"vision_vocab_size .*must exceed the <eov> id {EOV_ID}"):
        load_config(DEBUG, [f"model.vision_vocab_size={EOV_ID}"])
    assert load_config(DEBUG, [f"model.vision_vocab_size={EOV_ID + 1}"]).model.vision_vocab_size


def test_unknown_keys_are_named_together_and_a_config_of_another_kind_says_so(tmp_path) -> None:
    """The keys unknown in one section are named in one message with that section's valid keys
    once; a config of another kind (a VQGAN's given to `lwm train`) says that, in a line of
    readable length (it repeated every valid key for each unknown one: 6 KB)."""
    (tmp_path / "two.yaml").write_text(f"base: {DEBUG}\nmodel:\n  wide: 1\n  deep: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "two.yaml")
    message = str(info.value)
    assert message.startswith("unknown config keys 'model.wide', 'model.deep'; valid keys in ")
    assert message.count("hidden_size") == 1
    with pytest.raises(ConfigError, match="^is it a config of another kind than Config") as info:
        load_config(CONFIGS / "vqgan" / "tiny.yaml")
    assert len(str(info.value)) < 300 and "'model.resolution'" in str(info.value), info.value


def test_a_folder_given_as_the_config_is_named_as_such(tmp_path) -> None:
    with pytest.raises(ConfigError, match=f"config file '{tmp_path}' is a folder; give a .yaml"):
        load_config(tmp_path)
