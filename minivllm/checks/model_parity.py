"""Our model against transformers' in bfloat16, under teacher forcing, on the `qwen3-0.6b` preset
(or any preset: `llama-3.2-1b` and `qwen2.5-0.5b` load through the deep dive model_zoo's table).

    python -m minivllm.checks.model_parity [--out figures] [--num-tokens 1024]

Writes the preset to a temporary folder (timed), loads it with `minivllm.load_model` (timed; the
folder was just written, so it is read from the page cache) and with transformers, runs one prompt
of random token ids through both and compares the logits at every position. transformers in float32
is the reference that tells how far bfloat16 rounding alone moves the logits: the same comparison is
made for transformers' own bfloat16 model. Writes OUT/model_parity.json.
"""

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from minivllm.checkpoint import write_checkpoint
from minivllm.models.loader import load_model
from minivllm.testing import prompt_logits


def rope_theta_of(config: Any) -> float:
    """config's RoPE base, whichever transformers wrote it (scaled RoPE too: Llama 3's)."""
    params = getattr(config, "rope_parameters", None) or {}
    return params.get("rope_theta", getattr(config, "rope_theta", 10000.0))


OUT = Path("figures")  # the default --out: under the current directory


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(on: torch.device, fn, *args, **kwargs):
    """fn(*args, **kwargs) and its wall time in seconds (synchronised on a GPU)."""
    _sync(on)
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    _sync(on)
    return result, time.perf_counter() - start


DECISIVE_MARGIN = 0.1  # logits; bf16 rounding moves a logit by up to ~0.06 on this model


def compare(logits: torch.Tensor, ref: torch.Tensor, decisive: torch.Tensor) -> dict:
    """Max and mean |difference| and top-1 agreement of two (num_tokens, vocab_size) logit tensors;
    also the agreement at the `decisive` positions, where float32's top-1 beats its top-2 by more
    than rounding can move."""
    logits, ref = logits.float(), ref.float()
    diff = (logits - ref).abs()
    agree = logits.argmax(-1) == ref.argmax(-1)
    return dict(
        max_abs_logit_error=diff.max().item(),
        mean_abs_logit_error=diff.mean().item(),
        top1_agreement=agree.float().mean().item(),
        top1_agreement_decisive=agree[decisive].float().mean().item(),
    )


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def run_model_parity(
    preset: str = "qwen3-0.6b",
    num_tokens: int = 1024,
    seed: int = 0,
    device: str | torch.device | None = None,
    attn_implementation: str = "sdpa",
) -> dict:
    # imported here: notebook 06 imports greedy_agreement, and the core runs without deep dives
    from minivllm.models.zoo import ZOO  # every family (deep dive model_zoo)

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.zeros(1, device=device)  # create the CUDA context outside the timings
    logits, load_s = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        path, write_s = _timed(device, write_checkpoint, Path(tmp) / preset, preset, seed)
        tokenizer = AutoTokenizer.from_pretrained(path)
        rope_theta = rope_theta_of(AutoConfig.from_pretrained(path))
        generator = torch.Generator().manual_seed(seed)
        token_ids = torch.randint(0, len(tokenizer), (num_tokens,), generator=generator).tolist()
        for dtype in (torch.bfloat16, torch.float32):
            model, load_s[dtype] = _timed(
                device, load_model, path, dtype=dtype, device=device, models=ZOO
            )
            prompt_logits(model, token_ids[:16])  # warm-up: compiles the Triton kernel on a GPU
            logits["minivllm", dtype] = prompt_logits(model, token_ids).cpu()
            del model
            hf = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=attn_implementation
            )
            # transformers' `to`: see checkpoint/maker.py
            hf = hf.to(device).eval()  # type: ignore[arg-type]
            with torch.inference_mode():
                logits["transformers", dtype] = (
                    hf(torch.tensor([token_ids], device=device)).logits[0].cpu()
                )
            del hf
            if device.type == "cuda":
                torch.cuda.empty_cache()

    bf16, fp32 = torch.bfloat16, torch.float32
    ref = logits["transformers", fp32]
    top2 = ref.float().topk(2, dim=-1).values
    decisive = top2[:, 0] - top2[:, 1] > DECISIVE_MARGIN
    ours_vs_hf = compare(logits["minivllm", bf16], logits["transformers", bf16], decisive)
    return {
        "device": device_name(device),
        "command": f"python -m minivllm.checks.model_parity --preset {preset} --num-tokens "
        f"{num_tokens} --seed {seed}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "preset": preset,
        "num_tokens": num_tokens,
        "seed": seed,
        "attn_implementation": attn_implementation,
        "rope_theta": rope_theta,
        "write_checkpoint_s": round(write_s, 2),
        "load_model_bf16_s": round(load_s[torch.bfloat16], 2),
        **ours_vs_hf,  # the headline: minivllm bf16 vs transformers bf16
        "rows": [
            {"impl": "minivllm-bf16", "reference": "transformers-bf16", **ours_vs_hf},
            {
                "impl": "minivllm-bf16",
                "reference": "transformers-fp32",
                **compare(logits["minivllm", bf16], ref, decisive),
            },
            {
                "impl": "transformers-bf16",
                "reference": "transformers-fp32",
                **compare(logits["transformers", bf16], ref, decisive),
            },
            {
                "impl": "minivllm-fp32",
                "reference": "transformers-fp32",
                **compare(logits["minivllm", fp32], ref, decisive),
            },
        ],
        "reference_top1_margin_median": (top2[:, 0] - top2[:, 1]).median().item(),
        "decisive_margin": DECISIVE_MARGIN,
        "decisive_positions": int(decisive.sum()),
    }


# logits: far more than bfloat16 rounding moves one (DECISIVE_MARGIN's 0.1 on random weights)
CLEAR_CUT_MARGIN = 1.0


@torch.inference_mode()
def greedy_agreement(
    model: str | Path,
    outputs: list,
    dtype: torch.dtype = torch.bfloat16,
    margin: float = CLEAR_CUT_MARGIN,
) -> dict:
    """Teacher forcing: given each prompt and the greedy tokens an engine wrote (`RequestOutput`s),
    transformers' top token at every position of the completion. The share of our tokens it agrees
    with, over all of them and where its top-1 leads its top-2 by more than `margin` (clear-cut:
    rounding cannot flip those)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    hf = hf.to(device).eval()  # type: ignore[arg-type]
    same, clear = [], []
    for out in outputs:
        ours, start = out.outputs[0].token_ids, len(out.prompt_token_ids) - 1
        ids = torch.tensor([out.prompt_token_ids + ours], device=device)
        # the logits that chose each of our tokens
        logits = hf(ids).logits[0, start:-1].float().cpu()
        top2 = logits.topk(2).values
        same.append(logits.argmax(-1) == torch.tensor(ours))
        clear.append(top2[:, 0] - top2[:, 1] > margin)
    agree, decisive = torch.cat(same), torch.cat(clear)
    del hf
    return dict(
        tokens=len(agree),
        agreement=int(agree.sum()) / len(agree),
        clear_cut=int(decisive.sum()),
        agreement_clear_cut=int(agree[decisive].sum()) / int(decisive.sum())
        if decisive.any()
        else 1.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", type=Path, default=OUT, help="folder for model_parity.json (default: ./figures)"
    )
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--num-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = parser.parse_args()
    result = run_model_parity(args.preset, args.num_tokens, args.seed, args.device)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_parity.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out / 'model_parity.json'}")


if __name__ == "__main__":
    main()
