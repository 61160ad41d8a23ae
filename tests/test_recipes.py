"""Every recipe parses with the `seqpar` CLI parser (nothing is built or run); bad keys are named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_seqpar.cli.seqpar import SeqparCLI

RECIPES = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))


class _Parsed(Exception):
    def __init__(self, config) -> None:
        super().__init__("parsed")
        self.config = config


class ParseOnlyCLI(SeqparCLI):
    """Stops right after parsing and validating the config: no Trainer, model or data is built."""

    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config)


def parse(args: list[str]):
    with pytest.raises(_Parsed) as info:
        _make(args)
    return info.value.config


def _make(args: list[str]):
    import lightning

    from lightning_seqpar.cli.seqpar import names_a_module_class
    from lightning_seqpar.training.module import CausalLMModule

    own = names_a_module_class(args)  # a recipe of another LightningModule (LitGPTModule): subclass mode, as the CLI
    return ParseOnlyCLI(lightning.LightningModule if own else CausalLMModule, subclass_mode_model=own, datamodule_class=None,
                        subclass_mode_data=True, save_config_kwargs={"overwrite": True}, args=args)


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["seqpar"])


def test_there_are_recipes():
    assert {p.name for p in RECIPES} >= {"quickstart.yaml", "llama_7b.yaml", "llama_gqa.yaml", "llama_33h.yaml"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipe_parses(recipe):
    if recipe.name.startswith("litgpt"):
        pytest.importorskip("litgpt")
    config = parse(["fit", "--config", str(recipe)]).fit
    strategy = config.trainer.strategy
    assert strategy.class_path == "lightning_seqpar.SequenceParallelStrategy"
    assert config.data.class_path.startswith("lightning_seqpar.data.")
    seq_len = config.data.init_args.seq_len
    sp = strategy.init_args.sequence_parallel_size
    assert seq_len % (2 * sp) == 0  # zigzag needs 2 * sp chunks


def test_gpu_recipes_match_the_issue():
    for name, model in [("llama_7b", "llama-7b"), ("llama_gqa", "llama-7b-gqa"), ("llama_33h", "llama-33h")]:
        config = parse(["fit", "--config", str(RECIPES[0].parent / f"{name}.yaml")]).fit
        assert config.model.model == model
        assert (config.trainer.devices, config.trainer.precision) == (4, "bf16-true")
        assert config.data.init_args.seq_len == 128 * 1024


def test_quickstart_is_cpu_two_processes():
    config = parse(["fit", "--config", str(RECIPES[0].parent / "quickstart.yaml")]).fit
    assert (config.trainer.accelerator, config.trainer.devices) == ("cpu", 2)
    assert config.trainer.strategy.init_args.attention == "ring"
    assert config.model.model.n_kv_head < config.model.model.n_head  # GQA


def test_offload_params_is_a_recipe_key():
    """The strategy's offload_params (a bool) reaches the CLI like every other argument of its __init__."""
    recipe = str(RECIPES[0].parent / "llama3_8b_1m.yaml")
    assert parse(["fit", "--config", recipe]).fit.trainer.strategy.init_args.offload_params is False
    config = parse(["fit", "--config", recipe, "--trainer.strategy.init_args.offload_params=true"]).fit
    assert config.trainer.strategy.init_args.offload_params is True


@pytest.mark.parametrize(
    "override,named",
    [
        ("--trainer.strategy.init_args.sequence_parallel_sizes=2", "sequence_parallel_sizes"),
        ("--trainer.strategy.init_args.attention=flash", "attention"),
        ("--model.lr_max=1", "lr_max"),
        ("--data.init_args.seq_length=64", "seq_length"),
    ],
)
def test_bad_keys_are_named(override, named, capsys):
    with pytest.raises(SystemExit):
        parse(["fit", "--config", str(RECIPES[0].parent / "quickstart.yaml"), override])
    assert named in capsys.readouterr().err


def test_bad_key_in_a_recipe_file(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((RECIPES[0].parent / "quickstart.yaml").read_text().replace("n_kv_head: 2", "n_kv_heads: 2"))
    with pytest.raises(SystemExit):
        parse(["fit", "--config", str(bad)])
    assert "n_kv_heads" in capsys.readouterr().err


def test_hybrid_cpu_recipe_builds_a_transformers_hybrid():
    """recipes/hybrid_tiny_cpu.yaml gives the model as an HFConfigSpec (model_type + config): it parses, and the module
    builds transformers' Qwen3-Next from it with its gated DeltaNet layers replaced by the sequence-parallel twins."""
    pytest.importorskip("transformers")
    from lightning_seqpar.hf import HFConfigSpec
    from lightning_seqpar.hf.hybrid import is_hybrid_twin
    from lightning_seqpar.training.module import CausalLMModule

    config = parse(["fit", "--config", str(RECIPES[0].parent / "hybrid_tiny_cpu.yaml")]).fit
    spec = config.model.model
    assert spec.model_type == "qwen3_next" and spec.config["linear_conv_kernel_dim"] == 4
    module = CausalLMModule(HFConfigSpec(model_type=spec.model_type, config=dict(spec.config)))
    module.configure_model()
    assert type(module.model.hf).__name__ == "Qwen3NextForCausalLM"
    assert sum(is_hybrid_twin(m) for m in module.model.hf.modules()) == 3
    with pytest.raises(ValueError, match="give model_type once"):
        HFConfigSpec(model_type="llama", config={"model_type": "llama"}).as_dict()


def test_a_run_by_steps_gets_a_progress_bar_that_reads_epoch_n():
    """Note [The progress bar under max_steps]: `seqpar` adds TQDMProgressBar (not the Rich bar's "Epoch 1/-2") to a
    recipe that trains by max_steps, unless the bar is off, a progress bar is named or max_epochs is set."""
    from jsonargparse import Namespace

    from lightning_seqpar.cli.seqpar import TQDM_PROGRESS_BAR, step_progress_bar

    recipe = str(RECIPES[0].parent / "lora_finetune.yaml")
    trainer = parse(["fit", "--config", recipe]).fit.trainer
    assert trainer.max_steps == 500 and trainer.max_epochs is None
    assert step_progress_bar(trainer) and trainer.callbacks[-1].class_path == TQDM_PROGRESS_BAR
    assert [c.class_path.rsplit(".", 1)[1] for c in trainer.callbacks[:-1]] == ["ModelCheckpoint", "ThroughputMonitor"]
    assert not step_progress_bar(trainer)  # a progress bar is named now
    for flag in ("--trainer.enable_progress_bar=false", "--trainer.max_epochs=2"):
        trainer = parse(["fit", "--config", recipe, flag]).fit.trainer
        assert not step_progress_bar(trainer) and "ProgressBar" not in str(trainer.callbacks)
    rich = Namespace(max_steps=5, max_epochs=None, callbacks=[Namespace(class_path="lightning.pytorch.callbacks.RichProgressBar")])
    assert not step_progress_bar(rich)
    bare = Namespace(max_steps=5, max_epochs=None, callbacks=None)
    assert step_progress_bar(bare) and [c.class_path for c in bare.callbacks] == [TQDM_PROGRESS_BAR]
