"""The import paths that moved (issue #42) keep working for one release: each old path warns with a
DeprecationWarning naming the new one and gives the same objects; nothing of the project uses them."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent

# old module -> (new module, the public names it re-exports)
MOVED_MODULES = {
    "lightning_seqpar.hf_hybrid": ("lightning_seqpar.hf.hybrid", [
        "HYBRID_MIXERS", "SeqparFalconH1Mixer", "SeqparGatedDeltaNet", "SeqparKimiDeltaAttention", "SeqparLightningAttention",
        "SeqparMamba2Mixer", "SeqparMambaMixer", "SeqparOlmoHybridGatedDeltaNet", "SeqparRecurrentGemmaRecurrentBlock",
        "SeqparShortConv", "SeqparZambaMambaMixer", "apply_hf_hybrid", "configure_recurrence", "decoder_layer_index",
        "is_hybrid_twin"]),
    "lightning_seqpar.hf_support": ("lightning_seqpar.hf.support", [
        "FEATURES", "LONG", "MAX_PARAMS", "ORIGINAL", "SEQ_LEN", "VOCAB", "WINDOW", "Feature", "NotBuilt", "build_tiny_model",
        "causal_lm_architectures", "check_model_supported", "features_of", "is_packed_run", "main", "make_record",
        "refuse_unseen_position_features", "render_markdown", "tiny_config"]),
    "lightning_seqpar.lora": ("lightning_seqpar.hf.lora", [
        "adapter_state_dict", "apply_lora", "is_peft_model", "lora_config", "lora_hparams", "save_lora_pretrained",
        "upcast_trainable"]),
}
# names of lightning_seqpar.lora that moved elsewhere
LORA_ELSEWHERE = {"export_lora": "lightning_seqpar.hf.export", "is_plain": "lightning_seqpar.head"}
# names of lightning_seqpar.export that moved
EXPORT_MOVED = {
    **{name: "lightning_seqpar.hf.export" for name in (
        "MODULE_PREFIX", "TOKENIZER_FILES", "TokenizerSource", "describe_tokenizer", "export_hf", "export_tokenizer",
        "hf_config", "hf_state_dict", "llama_config", "tokenizer_source", "write_safetensors")},
    "load_meta": "lightning_seqpar.checkpoint_io",
    "load_model_state_dict": "lightning_seqpar.checkpoint_io",
}


def _fresh_import(name: str):
    """Import ``name`` anew (a module runs its body, and so warns, once per process)."""
    sys.modules.pop(name, None)
    parent, _, child = name.rpartition(".")
    if hasattr(sys.modules.get(parent), child):
        delattr(sys.modules[parent], child)
    return importlib.import_module(name)


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_an_old_module_path_warns_and_gives_the_same_objects(old):
    new, names = MOVED_MODULES[old]
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} is deprecated: import from {re.escape(new)}"):
        module = _fresh_import(old)
    target = importlib.import_module(new)
    for name in names:
        assert getattr(module, name) is getattr(target, name), name
    extra = LORA_ELSEWHERE if old == "lightning_seqpar.lora" else {}
    for name, where in extra.items():
        assert getattr(module, name) is getattr(importlib.import_module(where), name), name
    assert sorted(module.__all__) == sorted([*names, *extra, *(("head_operands", "logits_head") if extra else ())])


def test_the_old_lora_head_functions_are_the_head_interface_with_peft():
    peft = pytest.importorskip("peft")
    from peft.tuners.lora import Linear as LoraLinear

    from lightning_seqpar.head import head_operands, logits_head
    from lightning_seqpar.hf.lora import PEFT_HEAD

    with pytest.warns(DeprecationWarning):
        old = _fresh_import("lightning_seqpar.lora")
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False)
    adapted = LoraLinear(nn.Linear(8, 16, bias=False), "default", config=config, r=2, lora_alpha=4, init_lora_weights=False)
    hidden = torch.randn(2, 3, 8)
    got, want = old.head_operands(adapted, hidden), head_operands(adapted, hidden, adapters=(PEFT_HEAD,))
    assert got[0].shape[-1] == 8 + 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    torch.testing.assert_close(got[0] @ got[1].T, adapted(hidden), rtol=0, atol=1e-6)
    assert old.logits_head(adapted, "M") is logits_head(adapted, "M", adapters=(PEFT_HEAD,)) is adapted
    plain = nn.Linear(8, 16, bias=False)
    assert old.head_operands(plain, hidden)[1] is plain.weight


@pytest.mark.parametrize("name", sorted(EXPORT_MOVED))
def test_a_name_that_left_export_py_warns_and_is_the_same_object(name):
    import lightning_seqpar.export as export

    where = EXPORT_MOVED[name]
    with pytest.warns(DeprecationWarning, match=rf"lightning_seqpar\.export\.{name} moved to {re.escape(where)}\.{name}"):
        value = getattr(export, name)
    assert value is getattr(importlib.import_module(where), name)


def test_export_py_keeps_its_own_names_and_refuses_unknown_ones():
    import lightning_seqpar.export as export

    assert callable(export.main) and callable(export.export_consolidated)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        export.no_such_name  # noqa: B018


def test_the_old_table_command_still_writes_the_table(tmp_path):
    out = tmp_path / "hf_support.md"
    done = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "lightning_seqpar.hf_support",
                           "--record", str(ROOT / "docs" / "hf_support.json"), "--write", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "lightning_seqpar.hf_support is deprecated" in done.stderr
    assert out.read_text() == (ROOT / "docs" / "hf_support.md").read_text()


# ------------------------------------------------------------------------------------- nothing uses the old paths

_OLD = ("lightning_seqpar.lora", "lightning_seqpar.hf_hybrid", "lightning_seqpar.hf_support")
_OLD_IN_TEXT = re.compile(r"(?<![\w./])lightning_seqpar[./](?:lora|hf_hybrid|hf_support)\b(?!\.md)")


def _imports_of(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def test_nothing_of_the_project_imports_an_old_path():
    this = Path(__file__).resolve()
    shims = {ROOT / "lightning_seqpar" / f"{name.rpartition('.')[2]}.py" for name in _OLD}
    used = []
    for folder in ("lightning_seqpar", "tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.resolve() == this or path in shims:
                continue
            used += [f"{path.relative_to(ROOT)}: {name}" for name in _imports_of(path) if name in _OLD]
    texts = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "recipes").rglob("*.yaml"))]
    for path in texts:
        used += [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
                 if _OLD_IN_TEXT.search(line)]
    assert used == [], "the project still uses a deprecated path:\n" + "\n".join(used)
