"""The packed weights' memory: the row kernel's copies sharing one region on huge pages."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from opmux.models import load_model
from opmux.models._packed import PackedWeight, huge_page_region, place_row_weights
from opmux.models.synthetic import LlamaShape, write_random_llama

_HUGE_PAGE = 2 << 20
_NATIVE_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _thp_mode() -> str:
    """The bracketed word of the kernel's transparent-huge-page setting ('' if unknown)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def _smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


def test_a_huge_page_region_starts_on_a_huge_page_and_holds_what_is_written() -> None:
    region = huge_page_region(3 * _HUGE_PAGE + 100)
    assert region.dtype == torch.uint8 and region.numel() == 3 * _HUGE_PAGE + 100
    assert region.data_ptr() % _HUGE_PAGE == 0
    region.fill_(7)
    assert int(region[-1]) == 7 and int(region.sum()) == 7 * region.numel()
    assert huge_page_region(0).numel() == 0


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="this kernel gives no transparent huge pages on request")
def test_the_region_asks_for_huge_pages() -> None:
    region = huge_page_region(2 * _HUGE_PAGE)
    region.fill_(1)
    assert _smaps_entry(region.data_ptr()).get("THPeligible") == "1"


@pytest.mark.skipif(not _NATIVE_BF16, reason="bfloat16 weights get row copies on CPUs "
                    "that compute in bfloat16")
def test_a_packed_models_row_copies_share_one_region(tmp_path: Path) -> None:
    shape = LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=96)
    model = load_model(write_random_llama(tmp_path, shape, seed=1), torch.bfloat16)
    model.pack_weights()
    packs = [m.packed_weight for m in model.modules() if "packed_weight" in m.__dict__]
    assert len(packs) == 4 * shape.layers + 1
    xs = {k: torch.randn(1, k, dtype=torch.bfloat16) for k in (shape.hidden, 96)}
    ptrs = []
    with torch.inference_mode():
        for p in packs:
            x = xs[p.weight.shape[1]]
            want = torch.nn.functional.linear(x.float(), p.weight.float())
            torch.testing.assert_close(p(x).float(), want, rtol=2e-2, atol=2e-2)
            ptrs.append(p._rows.data_ptr())
    # one region from a huge-page boundary, the copies one after another on cache lines
    assert min(ptrs) % _HUGE_PAGE == 0
    spans = sorted((p._rows.data_ptr(), p._rows.numel() * 2) for p in packs)
    assert all(b == a + -(-n // 64) * 64 for (a, n), (b, _) in itertools.pairwise(spans))
    # packing again places nothing twice; a new weight's copy gets a region of its own
    before = {id(p): p._rows.data_ptr() for p in packs}
    extra = PackedWeight(torch.randn(24, 64, dtype=torch.bfloat16), None)
    place_row_weights([*packs, extra])
    with torch.inference_mode():
        for p in packs:
            p(xs[p.weight.shape[1]])
        extra(xs[shape.hidden])
    assert {id(p): p._rows.data_ptr() for p in packs} == before
    assert extra._rows.data_ptr() % _HUGE_PAGE == 0


def test_a_packed_float32_models_weights_move_onto_one_region(tmp_path: Path) -> None:
    """The row kernel reads float32 weights in place: packing moves their data (the same
    parameters, the same values) into one region, and the layers' own path still reads them."""
    shape = LlamaShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, vocab=96)
    model = load_model(write_random_llama(tmp_path, shape, seed=2))
    before = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    model.pack_weights()
    packs = [m.packed_weight for m in model.modules() if "packed_weight" in m.__dict__]
    assert packs and all(p.weight.dtype == torch.float32 for p in packs)
    for name, p in model.named_parameters():
        assert p is before[name][0] and torch.equal(p, before[name][1]), name
    ptrs = sorted((p.weight.data_ptr(), p.weight.numel() * 4) for p in packs)
    assert ptrs[0][0] % _HUGE_PAGE == 0
    assert all(b == a + -(-n // 64) * 64 for (a, n), (b, _) in itertools.pairwise(ptrs))
    # placed once: packing again moves nothing
    model.pack_weights()
    assert sorted((p.weight.data_ptr(), p.weight.numel() * 4) for p in packs) == ptrs
