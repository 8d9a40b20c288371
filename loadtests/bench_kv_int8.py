"""int8 KV for transfer and storage: bytes saved, logit error, greedy agreement.

    .venv/bin/python -m loadtests.bench_kv_int8 [--prompts 16] [--tokens 32] [--model DIR]

For each prompt, engine A prefills it; its KV goes through the same frames the services send
(`tensor_to_frames(..., int8=True)` with per-row float32 scales) into engine B, which decodes. The
same prompt also goes through a float32 transfer. Reports wire bytes, the max |logit| difference
of the first decoded position, and greedy agreement of the continuations.
"""

from __future__ import annotations

import argparse
import random

import torch

from services.cluster_config import ensure_model
from shared.engine import commands as cmd
from shared.engine.engine import LLMEngine
from shared.engine.params import EngineConfig
from shared.kvtransfer.frames import frame_nbytes, frames_to_tensor, tensor_to_frames
from shared.model.loader import load_model
from shared.protocol.sampling import SamplingParams


def transfer(kv: torch.Tensor, int8: bool) -> tuple[torch.Tensor, int]:
    frames = tensor_to_frames(kv, int8=int8)
    out = frames_to_tensor(frames, dtype=kv.dtype)
    return out, sum(frame_nbytes(f) for f in frames)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model_dir = ensure_model(args.model)
    loaded = load_model(model_dir)
    cfg = EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_caching=False)
    a, b = LLMEngine(loaded, cfg), LLMEngine(loaded, cfg)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    agree = total = 0
    bytes_fp = bytes_q = 0
    max_err = 0.0
    for i in range(args.prompts):
        prompt = [rng.randrange(10, loaded.config.vocab_size) for _ in range(args.prompt_tokens)]
        a.add_request(f"p{i}", prompt, first, hold_kv=True)
        tok0 = None
        while a.has_unfinished_requests():
            for o in a.step():
                tok0 = (o.new_token_ids or [tok0])[0]
        kv = cmd.ReadKV(f"p{i}").run(a).tokens().contiguous()
        a.release(f"p{i}")
        outs = {}
        for int8 in (False, True):
            moved, nbytes = transfer(kv, int8)
            if int8:
                bytes_q += nbytes
                max_err = max(max_err, (moved - kv).abs().max().item())
            else:
                bytes_fp += nbytes
            rid = f"d{i}{int8}"
            # the decode side's path: reserve, write the received KV, commit
            cmd.ReserveKV(rid, len(prompt)).run(b)
            cmd.WriteKV(rid, range(moved.shape[0]), 0, moved).run(b)
            cmd.AddPrefilled(rid, prompt, tok0, params).run(b)
            toks = []
            while b.has_unfinished_requests():
                for o in b.step():
                    toks += o.new_token_ids
            outs[int8] = toks
        total += len(outs[False])
        agree += sum(x == y for x, y in zip(outs[False], outs[True], strict=False))
    print(
        f"model: {model_dir}, {args.prompts} prompts x {args.prompt_tokens} tokens, "
        f"{args.tokens} greedy tokens each"
    )
    print("| KV on the wire | bytes | ratio |\n|---|---:|---:|")
    print(
        f"| float32 | {bytes_fp} | 1.00x |\n| int8 + per-row scales | {bytes_q} | "
        f"{bytes_fp / bytes_q:.2f}x smaller |"
    )
    print(f"\nmax |KV error| after int8 round trip: {max_err:.4g}")
    print(
        f"greedy agreement (position-wise) int8 vs float32 KV: {agree}/{total} "
        f"= {agree / total:.1%}"
    )


if __name__ == "__main__":
    main()
