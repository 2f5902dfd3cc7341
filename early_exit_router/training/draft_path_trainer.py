"""`DraftPathTrainer`: `adapt_base`'s run for a base-exact draft path (`AdaptConfig.scope == "draft"`).

A PEFT LoRA on layers 0..E alone (`layers_to_transform`) and exit E's head (the router's trained adapter where it has
one, else the model's own norm and head) learn together to predict the original model's next token: KL(original's
last layer || the adapted layers 0..E through the head), over the trimmed draft vocabulary. Nothing past layer E
runs in the student's pass, and there is no closeness term: the model itself never changes (the LoRA is merged into
copies of those layers when the router loads, `heads/draft_path.py`). Stopping, resuming and the curve are
`LayerSkipTrainer`'s; the head's weights are part of the saved state.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

from early_exit_router.heads.draft import DraftHead, exit_normed
from early_exit_router.models.architecture import run_in_place_of
from early_exit_router.training.config import AdaptConfig
from early_exit_router.training.layerskip_trainer import EVAL_CHUNKS, LayerSkipTrainer, _kl

HEAD_PREFIX = "exit_head."  # the head's weights in the saved state, beside the LoRA's


class DraftPathTrainer(LayerSkipTrainer):
    """One draft-path run: the LoRA on layers 0..E and a copy of exit E's head train; the caller's head stays."""

    def __init__(
        self, model: nn.Module, chunks: torch.Tensor, cfg: AdaptConfig, state_dir: Path, head: nn.Module | None
    ) -> None:
        self.exit_layer = cfg.exit_layers[0]
        super().__init__(model, chunks, cfg, state_dir)
        self.head = copy.deepcopy(head).to(self.stack.dtype).requires_grad_(True) if head is not None else None
        self.initial_head = copy.deepcopy(head) if head is not None else None  # the "before" of the report
        if self.head is not None:
            head_params = list(self.head.parameters())
            self.params += head_params
            self.optimizer.add_param_group({"params": head_params, "lr": cfg.lr})

    def lora_layers(self) -> list[int] | None:
        return list(range(self.exit_layer + 1))

    def trainables(self) -> dict[str, nn.Parameter]:
        own = {} if self.head is None else {HEAD_PREFIX + n: p for n, p in self.head.named_parameters()}
        return {**super().trainables(), **own}

    def exit_logits(self, ids: torch.Tensor, draft: DraftHead, head: nn.Module | None) -> torch.Tensor:
        """(b, n, K) the draft path's logits over the trimmed vocabulary: layers 0..E (adapted, unless the LoRA is
        off) over a fresh cache, then `head`."""
        stack = self.stack
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand(ids.shape[0], -1)
        layers = list(stack.layers[: self.exit_layer + 1])  # the model's own modules, the LoRA inside them
        hidden = run_in_place_of(stack, layers, stack.embed(ids), stack.new_cache(), positions)
        return stack.finish_logits(draft(exit_normed(stack, head, hidden)))

    def train_step(self, draft: DraftHead) -> dict[str, float]:
        ids = self.batch(self.step)
        with torch.no_grad(), self.teacher() as teacher, self._autocast():
            teacher.eval()
            t_logits = teacher(input_ids=ids, use_cache=False).logits.float()[..., draft.token_ids]
            t_draft = torch.log_softmax(t_logits, dim=-1)
        self.model.train()
        with self._autocast():
            s_logits = self.exit_logits(ids, draft, self.head)
        loss = _kl(t_draft, s_logits.float(), ids, self.cfg.ce_weight, draft.token_ids)
        self.optimise(loss)
        return {str(self.exit_layer): float(loss.detach())}

    @torch.no_grad()
    def heldout_quality(self, draft: DraftHead) -> dict[str, Any]:
        """The draft path's top-1 against the original model's on the held-out chunks, before (the LoRA off, the head
        as it came) and now; the model's own output is the original's by construction."""
        chunks, e = self.heldout[:EVAL_CHUNKS].to(self.stack.device), str(self.exit_layer)
        if self._original_figures is None:  # the original and the path as it started do not change: measured once
            with self.teacher() as original:
                original.eval()
                top1 = original(input_ids=chunks, use_cache=False).logits.argmax(-1)
                before = draft.token_ids[self.exit_logits(chunks, draft, self.initial_head).argmax(-1)]
            self._original_figures = {"top1": top1, "exit": round(float((before == top1).float().mean()), 4)}
        top1 = self._original_figures["top1"]
        after = draft.token_ids[self.exit_logits(chunks, draft, self.head).argmax(-1)]
        return {
            "last_agreement": 1.0,  # the model is not changed
            "exit_agreement": {e: round(float((after == top1).float().mean()), 4)},
            "exit_agreement_original": {e: self._original_figures["exit"]},
            "positions": int(top1.numel()),
        }
