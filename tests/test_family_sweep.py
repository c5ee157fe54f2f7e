"""Every MoE family of the installed transformers: attach, count exactly, detach bit-identically.

The families are read from transformers (:func:`family_sweep_models.router_families` documents the selection
rule), never listed by hand, so a new transformers release shows its new routers here as failing tests. Each
family gets a tiny random model; the probe's counts must equal an independent recount from a forward hook of
our own on every router, and the model's output after ``detach()`` must equal the output before ``attach()``
bit for bit. The test id of each case is the family's module name, so ``pytest -v`` lists every family run.

A family that cannot be built tiny is an xfail with the reason; a family whose routers mla_watch refuses is
listed in :data:`REFUSED` with the reason, and its test checks that attach refuses it naming the class and
``register_router`` - never a crash in a forward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import mla_watch
from mla_watch.probe import DEFAULT_REGISTRY
from tests.family_sweep_models import VOCAB, Family, router_families, tiny_model

pytestmark = pytest.mark.slow

# Families attach refuses (UnknownRouterError naming the class and register_router), and why.
REFUSED = {
    "switch_transformers": "capacity-dropping top-1 router returning a one-hot dispatch mask, in an "
    "encoder-decoder model; the probe counts decoder-only causal LMs",
    "nllb_moe": "capacity-dropping top-2 router returning only the top-1 mask, in an encoder-decoder model",
}

# Families whose tiny model cannot be built from the default config with shrunk sizes, and why.
CANNOT_BUILD = {
    "bailing_hybrid": "tiny config: the linear-attention layers index past the shrunk head count",
    "deepseek_ocr2": "no text-only model class: the model needs image inputs",
    "dots3_note": "per-layer configs (per_layer_config) cannot be shrunk by the generic rule",
    "ernie4_5_vl_moe": "text and vision experts split by modality ids the text-only forward does not give",
    "mistral4": "tiny config: its rotary embedding pairs dims that the shrunk MLA head does not have",
    "qwen3_omni_moe": "no text-only model class in the auto mappings (thinker/talker need the omni config)",
    "unlimited_ocr": "no text-only model class: the model needs image inputs",
}

FAMILIES = router_families()
BATCH, SEQ = 2, 6


def _cases() -> list:
    cases = []
    for family in FAMILIES:
        marks = [pytest.mark.xfail(reason=CANNOT_BUILD[family.module])] if family.module in CANNOT_BUILD else []
        cases.append(pytest.param(family, id=family.module, marks=marks))
    return cases


def _output(model: torch.nn.Module, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        output = model(input_ids=input_ids, attention_mask=mask, use_cache=False)
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state


class Recount:
    """Our own hook on every router the probe watches: each call's chosen slots, read with the router's spec."""

    def __init__(self, model: torch.nn.Module, probe: mla_watch.Probe) -> None:
        modules = dict(model.named_modules())
        config = getattr(model, "config", None)
        self.chosen: dict[str, list[torch.Tensor]] = {info.name: [] for info in probe.routers}
        self.handles = []
        for info in probe.routers:
            spec = DEFAULT_REGISTRY.spec_for(modules[info.name], config)
            self.handles.append(modules[info.name].register_forward_hook(self._keep(info.name, spec.indices)))

    def _keep(self, name: str, indices: Callable) -> Callable:
        def hook(module, args, output):
            self.chosen[name].append(indices(output).detach().clone().to(torch.int64))

        return hook

    def counts(self, info: mla_watch.RouterInfo, valid: torch.Tensor) -> np.ndarray:
        counts = np.zeros(info.num_slots, dtype=np.int64)
        for chosen in self.chosen[info.name]:
            if info.kind == "expert":
                picks = chosen.reshape(BATCH, SEQ, -1)[valid]  # padding tokens are not counted
                counts += np.bincount(picks.reshape(-1).numpy(), minlength=info.num_slots)
                continue
            picks = chosen.reshape(BATCH, SEQ, -1)
            for row in range(BATCH):
                for query in range(SEQ):
                    keys = picks[row, query]
                    keys = keys[(keys >= 0) & (keys <= query) & (keys < info.num_slots)]
                    counts += np.bincount(keys.numpy(), minlength=info.num_slots)
        return counts

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _refusal(family: Family) -> None:
    model = tiny_model(family)
    with pytest.raises(mla_watch.UnknownRouterError) as caught:
        mla_watch.attach(model)
    message = str(caught.value)
    assert "register_router" in message
    assert any(name in message for name in family.router_classes), message


@pytest.mark.parametrize("family", _cases())
def test_family_counts_exactly_and_detaches_bit_identically(family: Family) -> None:
    if family.module in REFUSED:
        _refusal(family)
        return
    model = tiny_model(family)
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(input_ids)
    before = _output(model, input_ids, mask)

    probe = mla_watch.attach(model, window_tokens=None)
    recount = Recount(model, probe)
    during = _output(model, input_ids, mask)
    recount.remove()
    counts = probe.counts()
    assert probe.routers, f"{family.module}: attach found no routers"
    valid = mask.bool()
    for info in probe.routers:
        assert recount.chosen[info.name], f"{info.name} never ran"
        np.testing.assert_array_equal(counts[info.name], recount.counts(info, valid), err_msg=info.name)
        if info.kind == "expert":
            assert counts[info.name].sum() == int(valid.sum()) * info.top_k * len(recount.chosen[info.name])
    probe.detach()
    after = _output(model, input_ids, mask)
    assert torch.equal(before, during)
    assert torch.equal(before, after)


def test_the_sweep_reads_its_families_from_transformers() -> None:
    modules = {family.module for family in FAMILIES}
    # Families named in the issue: if one vanished, the selection rule broke, not transformers.
    assert {
        "mixtral",
        "llama4",
        "zaya",
        "dbrx",
        "hunyuan_v1_moe",
        "jetmoe",
        "longcat_flash",
        "deepseek_v4",
        "glm5_next",
    } <= modules
    assert set(REFUSED) | set(CANNOT_BUILD) <= modules | {"nllb_moe"}
