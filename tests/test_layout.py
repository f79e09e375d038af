"""KV-cache layouts: physical order, interiors as DESIGN.md writes them, in-place V conversion."""

import pytest
import torch

from inductor_rocm_attn.kernels import reference as ref
from inductor_rocm_attn.layout import (
    CacheLayout,
    KVCacheSpec,
    allocate_kv_cache,
    cache_layout_of,
    cache_x,
    convert_v_layout_,
    customize_spec,
    dense_kv,
    k_view,
    v_view,
)

NB, BS, H, D = 5, 32, 2, 64


def _filled(layout, dtype=torch.float16, interleaved=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    cache = allocate_kv_cache(KVCacheSpec(BS, H, D, dtype, CacheLayout(layout)), NB)
    cache.view(torch.uint8).fill_(0xFF)
    k, v = torch.randn(NB * BS, H, D, generator=g), torch.randn(NB * BS, H, D, generator=g)
    ref.reshape_and_cache(k, v, cache, torch.randperm(NB * BS, generator=g), torch.ones(1), torch.ones(1),
                          interleaved)
    return cache


def test_physical_orders():
    lh = allocate_kv_cache(KVCacheSpec(BS, H, D, torch.float16, CacheLayout.LHBNC), NB)
    lb = allocate_kv_cache(KVCacheSpec(BS, H, D, torch.float16, CacheLayout.LBHNC), NB)
    page = BS * H * D
    assert lh.shape == lb.shape == (NB, 2, BS, H * D)
    # LHBNC: the K group of all blocks first, then V; LBHNC: K then V of each block.
    assert lh[:, 1].storage_offset() - lh.storage_offset() == NB * page and lh.stride(0) == page
    assert lb.stride(0) == 2 * page and lb.stride(1) == page
    assert cache_layout_of(lh) == CacheLayout.LHBNC and cache_layout_of(lb) == CacheLayout.LBHNC


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float8_e4m3fn])
def test_interiors_match_design_formulas(dtype):
    cache = allocate_kv_cache(KVCacheSpec(BS, H, D, dtype, CacheLayout.LBHNC), NB)
    x = cache_x(dtype)
    assert x == 16 // cache.element_size()
    flat = cache.view(-1)
    flat.view(torch.uint8).zero_()
    b, h, t, d = 3, 1, 21, 37
    page = BS * H * D
    k_view(cache, H)[b, h, d // x, t, d % x] = 1.0
    v_view(cache, H, interleaved=False)[b, h, d, t] = 2.0
    base_k = b * 2 * page + h * D * BS
    assert float(flat[base_k + (d // x) * BS * x + t * x + d % x]) == 1.0
    base_v = b * 2 * page + page + h * D * BS
    assert float(flat[base_v + d * BS + t]) == 2.0
    v_view(cache, H, interleaved=False)[b, h, d, t] = 0.0
    v_view(cache, H, interleaved=True)[b, h, t // x, d, t % x] = 3.0
    assert float(flat[base_v + (t // x) * D * x + d * x + t % x]) == 3.0  # docs/design.md's formula


@pytest.mark.parametrize("layout", ["LHBNC", "LBHNC"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2])
def test_convert_v_layout_in_place_round_trip(layout, dtype):
    cache = _filled(layout, dtype=dtype, interleaved=False, seed=1)
    k0, v0 = dense_kv(cache, H, interleaved_v=False)
    ptr = cache.data_ptr()
    convert_v_layout_(cache, H, to_interleaved=True)
    assert cache.data_ptr() == ptr
    k1, v1 = dense_kv(cache, H, interleaved_v=True)
    assert torch.equal(k0.view(torch.uint8), k1.view(torch.uint8))
    assert torch.equal(v0.view(torch.uint8), v1.view(torch.uint8))
    # The bytes really moved (the two interiors differ) ...
    _, v_wrong = dense_kv(cache, H, interleaved_v=False)
    assert not torch.equal(v_wrong.view(torch.uint8), v0.view(torch.uint8))
    convert_v_layout_(cache, H, to_interleaved=False)
    k2, v2 = dense_kv(cache, H, interleaved_v=False)
    assert torch.equal(v0.view(torch.uint8), v2.view(torch.uint8))


def test_customize_spec():
    spec = customize_spec(544, 8, 128, torch.bfloat16, "LBHNC")
    assert spec.num_head_slots == 2
    assert spec.state_content_bytes == 8 * 128 * 2  # one token in one head slot (the seed's meaning)
    assert spec.page_size_bytes == 2 * 544 * 8 * 128 * 2  # one block: a K page and a V page
    assert spec.logical_shape(7) == (7, 2, 544, 1024)
    cache = allocate_kv_cache(spec, 7)
    assert cache.untyped_storage().nbytes() == 7 * spec.page_size_bytes
    assert cache.stride(1) * cache.element_size() == spec.block_size * spec.state_content_bytes


def test_bad_cache_tensor():
    with pytest.raises(ValueError, match="logical shape"):
        cache_layout_of(torch.empty(4, 3, 16, 64))
    with pytest.raises(ValueError, match="match neither LHBNC nor LBHNC"):
        cache_layout_of(torch.empty(4, 2, 16, 64).transpose(0, 1).contiguous().transpose(0, 1)[::2])


def test_convert_v_layout_refuses_another_geometry_before_moving_bytes():
    """A num_kv_heads that does not divide the cache width made views of another geometry and
    scrambled every V page in place; it is refused with the cache untouched."""
    cache = _filled("LHBNC", dtype=torch.float32)
    before = cache.clone()
    for heads in (3, 0, 2.0):
        with pytest.raises(ValueError, match=rf"convert_v_layout_: num_kv_heads {heads!r} does not divide the "
                                             rf"cache's last dim {H * D}"):
            convert_v_layout_(cache, heads, to_interleaved=True)
    with pytest.raises(ValueError, match=r"convert_v_layout_: head_size 16 is not supported"):
        convert_v_layout_(cache, 8, to_interleaved=True)  # 128 = 8 heads of 16 channels
    with pytest.raises(ValueError, match=r"kv_cache must have logical shape"):
        convert_v_layout_(cache[:, 0], H, to_interleaved=True)
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("kw, match", [
    (dict(num_kv_heads=0), r"customize_spec: num_kv_heads must be a positive int, got 0"),
    (dict(num_kv_heads=2.0), r"customize_spec: num_kv_heads must be a positive int, got 2\.0"),
    (dict(dtype=torch.int32), r"customize_spec: dtype torch\.int32 is not a cache dtype"),
    (dict(dtype="float16"), r"customize_spec: dtype 'float16' is not a cache dtype"),
])
def test_customize_spec_refuses_what_no_op_reads(kw, match):
    args = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        customize_spec(**args)


def test_allocate_kv_cache_arguments():
    """0 (or True) blocks gave an empty (or one-block) cache, -1 and 2.5 torch's errors; a spec
    with an integer dtype or three head slots a cache no op reads."""
    spec = KVCacheSpec(16, 2, 64, torch.float16)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=rf"allocate_kv_cache: num_blocks must be a positive int, got {bad!r}"):
            allocate_kv_cache(spec, bad)
    with pytest.raises(ValueError, match=r"allocate_kv_cache: dtype torch\.int8 is not a cache dtype"):
        allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.int8), 4)
    with pytest.raises(ValueError, match=r"allocate_kv_cache: num_head_slots must be 2 \(K and V\), got 3"):
        allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.float16, num_head_slots=3), 4)
    with pytest.raises(ValueError, match=r"allocate_kv_cache: head_size 48 is not supported"):
        allocate_kv_cache(KVCacheSpec(16, 2, 48, torch.float16), 4)


def test_allocate_kv_cache_refuses_an_unknown_layout_and_device():
    """A KVCacheSpec built directly with a layout other than the two (a typo, a lower-case
    name) was allocated as LHBNC; a bad device string was torch's error naming no function."""
    for layout in ("LBHCN", "lbhnc", 3):
        with pytest.raises(ValueError, match=rf"allocate_kv_cache: layout {layout!r} is not supported; supported: "
                                             r"'LHBNC', 'LBHNC'"):
            allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.float16, layout), 4)
    assert cache_layout_of(allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.float16, "LBHNC"), 4)) == CacheLayout.LBHNC
    with pytest.raises(TypeError, match=r"allocate_kv_cache: spec must be a KVCacheSpec \(see customize_spec\), "
                                        r"got tuple"):
        allocate_kv_cache((16, 2, 64, torch.float16), 4)
    with pytest.raises(ValueError, match=r"allocate_kv_cache: device 'gpu' is not a torch device"):
        allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.float16), 4, "gpu")


@pytest.mark.parametrize("failure", [RuntimeError("DefaultCPUAllocator: can't allocate memory"),
                                     torch.OutOfMemoryError("CUDA out of memory")])
def test_allocate_kv_cache_names_a_cache_it_cannot_allocate(monkeypatch, failure):
    """The allocator's own error named neither the call nor the cache's size; a GPU's
    OutOfMemoryError keeps its class, the CPU allocator's RuntimeError is a MemoryError."""
    import inductor_rocm_attn.layout as layout_mod

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(layout_mod.torch, "empty", fail)
    expected = torch.OutOfMemoryError if isinstance(failure, torch.OutOfMemoryError) else MemoryError
    with pytest.raises(expected, match=r"allocate_kv_cache: 1000 blocks of 16 tokens x 128 channels x 2 "
                                       r"\(torch\.float16\) = 0\.01 GiB could not be allocated on cpu; use fewer "
                                       r"blocks \((OutOfMemoryError|RuntimeError): "):
        allocate_kv_cache(KVCacheSpec(16, 2, 64, torch.float16), 1000)


def test_dense_kv_checks_the_cache_and_its_heads():
    """dense_kv read any 4-D tensor through the cache views: a tensor of other strides (not a
    cache) came back as other elements, a non-dividing head count or a 3-D slice failed with
    torch's errors naming no function."""
    cache = _filled("LHBNC", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"dense_kv: kv_cache must be a cache \(or a slice of its blocks\) .* with "
                                         r"contiguous pages"):
        dense_kv(torch.randn(NB, 2, H * D, BS).transpose(2, 3), H, False)
    # a slice of a cache's blocks (a prefix, every other block) reads those blocks
    for sl in (slice(0, 2), slice(None, None, 2)):
        for a, b in zip(dense_kv(cache[sl], H, False), dense_kv(cache, H, False)):
            assert torch.equal(a, b[sl])
    with pytest.raises(ValueError, match=rf"dense_kv: num_kv_heads 3 does not divide the cache's last dim {H * D}"):
        dense_kv(cache, 3, False)
    with pytest.raises(ValueError, match=r"dense_kv: kv_cache must be a cache .* of logical shape"):
        dense_kv(cache[:, 0], H, False)
    k, v = dense_kv(cache, H, False)
    assert k.shape == v.shape == (NB, BS, H, D)
