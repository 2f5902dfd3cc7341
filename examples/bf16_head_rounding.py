"""How often a bf16 model's greedy choice differs from the float32 model's, and how much of that the LM head's
rounding causes (`precise_logits`, `early_exit_router/models/precise_logits.py`).

For every dev and held-out open-text prompt, plain HF bf16 greedy writes 64 tokens; both models then score that text
teacher-forced, and the script counts the positions where the float32 model's choice differs from:
- the bf16 model's own (bf16 logits);
- the float32 product of the bf16 model's normed final state with its bf16 head weights, over the 8 leading
  candidates (what `precise_logits` decides from);
- the same over the whole vocabulary (so the 8 candidates miss nothing).

    python examples/bf16_head_rounding.py   # about 2 minutes on 2 CPU cores
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import early_exit_router.data
from early_exit_router.models.loading import load_base_model
from early_exit_router.models.precise_logits import TOP_K


def encode(tokenizer, item: dict) -> torch.Tensor:
    if item.get("kind") == "chat":
        messages = [{"role": "user", "content": item["prompt"]}]
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        return encoded if torch.is_tensor(encoded) else encoded["input_ids"]
    return tokenizer(item["prompt"], return_tensors="pt").input_ids


def main() -> None:
    reference, tokenizer, _ = load_base_model("smollm2-135m", dtype=torch.float32)
    model, _, _ = load_base_model("smollm2-135m", dtype=torch.bfloat16)
    weight = model.lm_head.weight.float()  # the bf16 weights, exactly
    folder = Path(early_exit_router.data.__file__).parent
    files = [folder / "dev_prompts.jsonl", folder / "heldout_prompts.jsonl"]
    items = [json.loads(line) for path in files for line in path.read_text().splitlines() if line.strip()]
    counts = {"positions": 0, "bf16 logits": 0, f"float32 top-{TOP_K}": 0, "float32 full head": 0}
    for item in items:
        ids = encode(tokenizer, item)
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
        start = ids.shape[1] - 1
        with torch.no_grad():
            wanted = reference(out).logits[0, start:-1].argmax(-1)
            scored = model(out, output_hidden_states=True)
        normed = scored.hidden_states[-1][0, start:-1].float()  # the final norm's output, (n, hidden)
        logits = scored.logits[0, start:-1]
        top = logits.topk(TOP_K, dim=-1).indices  # (n, k)
        refined = top.gather(1, torch.einsum("nd,nkd->nk", normed, weight[top]).argmax(-1, keepdim=True))[:, 0]
        counts["positions"] += len(wanted)
        counts["bf16 logits"] += int((logits.argmax(-1) != wanted).sum())
        counts[f"float32 top-{TOP_K}"] += int((refined != wanted).sum())
        counts["float32 full head"] += int(((normed @ weight.T).argmax(-1) != wanted).sum())
    print(f"{len(items)} prompts, {counts.pop('positions')} positions; choices that differ from the float32 model's:")
    for name, count in counts.items():
        print(f"  {name}: {count}")


if __name__ == "__main__":
    main()
