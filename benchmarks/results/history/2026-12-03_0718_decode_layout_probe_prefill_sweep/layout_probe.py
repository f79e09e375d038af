"""Scratch probe: a plain one-loop decode kernel (vLLM unified_attention's loop shape: BLOCK_M 16,
per-token block-table vector, masked loads, one loop) over four cache layouts, same data,
next to our kernel and SDPA. Question: is our 3.3 TB/s the layout or the kernel shape?"""
import sys, os, json, itertools
import torch, triton, triton.language as tl
import torch.nn.functional as F
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import bench_decode as bd
from inductor_rocm_attn.layout import k_view, v_view, dense_kv

@triton.jit
def probe_kernel(out_ptr, q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, scale,
                 sk_blk, sk_head, sv_blk, sv_head, stride_bt, sk_tok: tl.constexpr, sv_tok: tl.constexpr,
                 SK_DIM: tl.constexpr, SV_DIM: tl.constexpr, HQ: tl.constexpr,
                 GQA: tl.constexpr, BLOCK_M: tl.constexpr, HEAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, XPACK: tl.constexpr,
                 X: tl.constexpr, SCALAR_BT: tl.constexpr, PREFETCH: tl.constexpr = 0, KMODE: tl.constexpr = 0,
                 k_desc=None, HKV: tl.constexpr = 8):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD)
    offs_t = tl.arange(0, TILE)
    m_ok = offs_m < GQA
    heads = h * GQA + offs_m
    q = tl.load(q_ptr + seq * HQ * HEAD + heads[:, None] * HEAD + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)
    seq_len = tl.load(seq_lens_ptr + seq)
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD], tl.float32)
    n_tiles = tl.maximum((seq_len + TILE - 1) // TILE, 0)
    if PREFETCH:  # block ids of tile j+1 loaded during tile j (clamped, so always in range)
        nxt = tl.load(bt_ptr + seq * stride_bt + offs_t // BLOCK_SIZE)
    for j in range(0, n_tiles):
        tok = j * TILE + offs_t
        tmask = tok < seq_len
        if PREFETCH:
            blk = nxt.to(tl.int64)
            jn = tl.minimum(j + 1, n_tiles - 1)
            nxt = tl.load(bt_ptr + seq * stride_bt + (jn * TILE + offs_t) // BLOCK_SIZE)
        elif SCALAR_BT:
            blk = (tl.load(bt_ptr + seq * stride_bt + (j * TILE) // BLOCK_SIZE).to(tl.int64)
                   + tl.zeros([TILE], tl.int64))
        else:
            blk = tl.load(bt_ptr + seq * stride_bt + tok // BLOCK_SIZE).to(tl.int64)
        blk = tl.max_constancy(blk, BLOCK_SIZE if TILE > BLOCK_SIZE else TILE)
        RUN: tl.constexpr = BLOCK_SIZE if TILE > BLOCK_SIZE else TILE
        in_blk = tl.max_contiguous(tl.multiple_of(tok % BLOCK_SIZE, RUN), RUN)
        rmask = (j * TILE + (offs_t // RUN) * RUN) < seq_len
        P: tl.constexpr = HEAD // X
        if KMODE == 1:  # x-packed page as [P, TILE, X]: lanes walk the tokens of a packet row
            offs_p = tl.arange(0, P)
            offs_x = tl.arange(0, X)
            k_off3 = (blk[None, :, None] * sk_blk + h * sk_head + offs_p[:, None, None] * (BLOCK_SIZE * X)
                      + in_blk[None, :, None] * X + offs_x[None, None, :])
            K3 = tl.load(k_ptr + k_off3, mask=rmask[None, :, None], other=0.0)
            K = tl.reshape(tl.permute(K3, (0, 2, 1)), (HEAD, TILE))
        elif KMODE == 3:  # [TILE, P, X]: the coalescer breaks the P/T tie toward dim 0 (tokens)
            offs_p = tl.arange(0, P)
            offs_x = tl.arange(0, X)
            k_off3 = (blk[:, None, None] * sk_blk + h * sk_head + offs_p[None, :, None] * (BLOCK_SIZE * X)
                      + in_blk[:, None, None] * X + offs_x[None, None, :])
            K3 = tl.load(k_ptr + k_off3, mask=rmask[:, None, None], other=0.0)
            K = tl.reshape(tl.permute(K3, (1, 2, 0)), (HEAD, TILE))
        elif KMODE == 4:  # the page as [P, BLOCK_SIZE * X] rows of 256 B (TILE == BLOCK_SIZE)
            bs = tl.max(blk, 0)
            offs_c = tl.arange(0, BLOCK_SIZE * X)
            offs_p = tl.arange(0, P)
            k_off2 = bs * sk_blk + h * sk_head + offs_p[:, None] * (BLOCK_SIZE * X) + offs_c[None, :]
            pmask = (j * TILE + offs_c // X) < seq_len
            K2 = tl.load(k_ptr + k_off2, mask=pmask[None, :], other=0.0)
            K = tl.reshape(tl.permute(tl.reshape(K2, (P, TILE, X)), (0, 2, 1)), (HEAD, TILE))
        elif KMODE == 2:  # TMA: the page as a [P, BLOCK_SIZE * X] box (TILE == BLOCK_SIZE)
            bs = tl.max(blk, 0)
            row = ((bs * HKV + h) * P).to(tl.int32)
            K2 = k_desc.load([row, 0])
            K = tl.reshape(tl.permute(tl.reshape(K2, (P, TILE, X)), (0, 2, 1)), (HEAD, TILE))
        else:
            if XPACK:
                k_off = (blk[None, :] * sk_blk + h * sk_head + (offs_d // X)[:, None] * (BLOCK_SIZE * X)
                         + in_blk[None, :] * X + (offs_d % X)[:, None])
            else:
                k_off = blk[None, :] * sk_blk + h * sk_head + offs_d[:, None] * SK_DIM + in_blk[None, :] * sk_tok
            # run-granular load mask (constant over a run, so loads vectorize); L is a tile multiple here
            K = tl.load(k_ptr + k_off, mask=rmask[None, :], other=0.0)
        v_off = blk[:, None] * sv_blk + h * sv_head + offs_d[None, :] * SV_DIM + in_blk[:, None] * sv_tok
        V = tl.load(v_ptr + v_off, mask=rmask[:, None], other=0.0)
        S = tl.dot(q, K) * scale
        S = tl.where(m_ok[:, None] & tmask[None, :], S, float("-inf"))
        m_j = tl.maximum(M, tl.max(S, 1))
        m_j = tl.where(m_j > float("-inf"), m_j, 0.0)
        P = tl.exp(S - m_j[:, None])
        alpha = tl.exp(M - m_j)
        acc = acc * alpha[:, None] + tl.dot(P.to(V.dtype), V)
        L = L * alpha + tl.sum(P, 1)
        M = m_j
    acc = acc / L[:, None]
    tl.store(out_ptr + seq * HQ * HEAD + heads[:, None] * HEAD + offs_d[None, :], acc, mask=m_ok[:, None])


def main():
    HQ, HKV, D, BS = bd.HQ, bd.HKV, bd.D, bd.BS
    res = []
    ceiling = bd.read_ceiling_tbs()
    print(f"read ceiling {ceiling:.2f} TB/s", flush=True)
    for b, L in [(64, 4096), (128, 4096)]:
        c = bd.DecodeCase(b, L, seed=b * 7 + L)
        k, v = c.dense()
        q4 = c.query.view(b, HQ, 1, D)
        ref = F.scaled_dot_product_attention(q4, k, v, scale=c.scale, enable_gqa=True).view(b, HQ, D).float()
        nbytes = 2 * b * L * HKV * D * 2 + 2 * b * HQ * D * 2
        kc, vc = k_view(c.kv_cache, HKV), v_view(c.kv_cache, HKV, False)
        kd, vd = dense_kv(c.kv_cache, HKV, False)  # NHD [nb, BS, HKV, D]
        # (name, k tensor, (blk, tok, head), SK_DIM, xpack, v tensor, (blk, tok, head), SV_DIM)
        nhd = (kd.stride(0), kd.stride(1), kd.stride(2))
        layouts = {
            "ours": (kc, (kc.stride(0), 0, kc.stride(1)), 1, True, vc, (vc.stride(0), 1, vc.stride(1)), BS),
            "nhd": (kd, nhd, 1, False, vd, nhd, 1),
            "nhdK_oursV": (kd, nhd, 1, False, vc, (vc.stride(0), 1, vc.stride(1)), BS),
            "oursK_nhdV": (kc, (kc.stride(0), 0, kc.stride(1)), 1, True, vd, nhd, 1),
        }
        t_ours = bd.graph_time_us(c.run)
        t_sdpa = bd.graph_time_us(lambda: F.scaled_dot_product_attention(q4, k, v, scale=c.scale, enable_gqa=True))
        print(f"B={b} L={L}: our kernel {t_ours:.1f} us {nbytes/t_ours/1e6:.2f} TB/s | sdpa {t_sdpa:.1f} us", flush=True)
        res.append(dict(B=b, L=L, what="ours_default", us=t_ours, tbs=nbytes / t_ours / 1e6))
        res.append(dict(B=b, L=L, what="sdpa", us=t_sdpa, tbs=nbytes / t_sdpa / 1e6))
        for cfg in []:
            try:
                t = bd.graph_time_us(lambda: c.run(decode_cfg=cfg))
            except Exception as e:
                print("  ours", cfg, type(e).__name__, flush=True)
                continue
            res.append(dict(B=b, L=L, what="ours_kernel", cfg=list(cfg), us=t, tbs=nbytes / t / 1e6))
            print(f"  our kernel cfg {cfg}: {t:7.1f} us {nbytes/t/1e6:5.2f} TB/s", flush=True)
        from triton.tools.tensor_descriptor import TensorDescriptor
        kflat = kc.as_strided((kc.shape[0] * HKV * (D // 8), BS * 8), (BS * 8, 1))
        assert kc.stride(0) == HKV * D * BS and kc.stride(1) == D * BS
        kdesc = TensorDescriptor(kflat, list(kflat.shape), [BS * 8, 1], [D // 8, BS * 8])
        runs = [("nhd", 0, 16, 1), ("nhdK_oursV", 0, 16, 1), ("ours", 0, 16, 1), ("ours", 4, 16, 1),
                ("ours", 1, 16, 1), ("ours", 3, 16, 1), ("ours", 2, 16, 1), ("ours", 3, 32, 2), ("ours", 1, 32, 2)]
        for name, kmode, tile, warps in runs:
            kt, ks, skd, xp, vt, vs, svd = layouts[name]
            out = torch.full_like(c.query, float("nan"))
            def run():
                probe_kernel[(b, HKV)](out, c.query, kt, vt, c.block_table, c.seq_lens, c.scale,
                                       ks[0], ks[2], vs[0], vs[2], c.block_table.stride(0), ks[1], vs[1],
                                       SK_DIM=skd, SV_DIM=svd, HQ=HQ, GQA=HQ // HKV, BLOCK_M=16, HEAD=D,
                                       BLOCK_SIZE=BS, TILE=tile, XPACK=xp, X=8, SCALAR_BT=0, PREFETCH=1,
                                       KMODE=kmode, k_desc=kdesc if kmode == 2 else None, HKV=HKV,
                                       num_warps=warps, num_stages=3)
            try:
                run(); torch.cuda.synchronize()
            except Exception as e:
                print(f"  {name} kmode={kmode} tile={tile} warps={warps}: {type(e).__name__} {str(e)[:300]}", flush=True)
                continue
            err = float((out.float() - ref).norm() / ref.norm())
            t = bd.graph_time_us(run)
            res.append(dict(B=b, L=L, what=name, kmode=kmode, tile=tile, warps=warps, us=t, tbs=nbytes / t / 1e6, err=err))
            print(f"  {name:12s} kmode={kmode} tile={tile:3d} warps={warps}: {t:7.1f} us {nbytes/t/1e6:5.2f} TB/s err {err:.1e}", flush=True)
        del c, k, v, kd, vd
        torch.cuda.empty_cache()
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "layout_probe.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, ceiling=ceiling, rows=res), f, indent=1)


if __name__ == "__main__":
    main()
