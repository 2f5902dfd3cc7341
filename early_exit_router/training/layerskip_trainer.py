"""`LayerSkipTrainer`: the training run of `adapt_base` (a base fine-tuned so that its shallow layers predict through
its own final norm and LM head).

The LayerSkip recipe (`layerskip.py`: early-exit loss, curricula, layer dropout), self-distilled: every supervised
layer's loss is KL(original model || that layer through the model's own head), the original being the same weights
with the LoRA switched off (PEFT's `disable_adapter`), or a frozen copy when every weight trains. The last layer's
term keeps the adapted model close to the original; the exits' terms teach the shallow layers to answer. The exits'
KL runs over the router's trimmed draft vocabulary (the distribution it drafts from), the last layer's over all.

A run saves a resumable state every `save_every` steps in `OUT/.adapt-state/` (the token chunks, the trainable
weights, the optimiser, the curve): the same call on the same folder continues where it stopped. The result is a
router folder (`adapt_base.py`, `heads/adapted_base.py`): the LoRA (or the merged model), identity heads at the exits
and the reports.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from early_exit_router.heads.checkpoint import head_hash
from early_exit_router.heads.draft import DraftHead
from early_exit_router.models._compat import quiet_peft
from early_exit_router.models.discovery import stack_for
from early_exit_router.models.kernels import native_bfloat16
from early_exit_router.training.adapt_quality import compare, measure, ranking_on
from early_exit_router.training.config import AdaptConfig
from early_exit_router.training.hidden_states import cut_chunks
from early_exit_router.training.layerskip import LayerTaps, curriculum_exits, dropout_rates, loss_scales

STATE_DIR = ".adapt-state"  # hidden: a router folder lets hidden entries be
EVAL_CHUNKS = 16  # held-out chunks the curve's periodic evaluation reads


def token_chunks(sequences: list[list[int]], seq_len: int) -> torch.Tensor:
    """The sequences concatenated and cut into (n, seq_len) chunks (the tail shorter than a chunk dropped)."""
    chunks = cut_chunks(sequences, seq_len)
    if len(chunks) < 2:
        tokens = sum(map(len, sequences))
        raise ValueError(f"The text is {tokens} tokens: adapt-base needs at least two {seq_len}-token chunks.")
    return chunks


def lora_targets(stack: Any) -> list[str]:
    """The leaf names of the decoder layers' projections (q_proj, ..., down_proj; GPT-2's Conv1D c_attn, ...): what
    the LoRA adapts."""
    from transformers.pytorch_utils import Conv1D

    kinds = (nn.Linear, Conv1D)
    names = sorted({name.rsplit(".", 1)[-1] for name, m in stack.layers.named_modules() if isinstance(m, kinds)})
    if not names:
        raise ValueError(
            "The decoder layers have no linear projection a LoRA can adapt: use method='full' (--method full)."
        )
    return names


@dataclass
class AdaptResult:
    steps_done: int
    finished: bool  # False: the run stopped early (run_steps / run_seconds); the same call continues it
    report: dict[str, Any]


class LayerSkipTrainer:
    """One adaptation run over token `chunks`: the model wrapped for training, its teacher, the optimiser, the
    state that resumes it."""

    def __init__(self, model: nn.Module, chunks: torch.Tensor, cfg: AdaptConfig, state_dir: Path) -> None:
        self.cfg, self.state_dir = cfg, state_dir
        self.stack = stack_for(model)
        last = self.stack.num_layers - 1
        if cfg.exit_layers[-1] >= last:
            raise ValueError(f"exit_layers {cfg.exit_layers}: every exit must be below the last layer ({last}).")
        gen = torch.Generator().manual_seed(cfg.seed)
        order = torch.randperm(len(chunks), generator=gen)
        n_held = max(1, round(len(chunks) * cfg.heldout_share))
        self.heldout, self.train = chunks[order[:n_held]], chunks[order[n_held:]]
        if len(self.train) < 1:
            raise ValueError(f"{len(chunks)} chunks leave none to train on after the held-out share: give more text.")
        # what the caller's model was, put back by `restore` (a LoRA run leaves it as it came)
        self.base, self._was_training = model, model.training
        self._grad_flags = [p.requires_grad for p in model.parameters()]
        self._tp = getattr(model.config, "pretraining_tp", None)  # PEFT sets it to 1
        self.base_fingerprint = head_hash(dict(self.stack.layers.named_parameters()))  # tells another base apart
        self.model = self._wrap(model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.taps = LayerTaps(self.stack.layers, torch.Generator().manual_seed(cfg.seed + 1))
        self.rates = dropout_rates(self.stack.num_layers, cfg.layer_dropout, cfg.dropout_shape)
        self.step, self.seconds, self.curve = 0, 0.0, []
        self.ranking: torch.Tensor | None = None
        self._original_figures: dict[str, Any] | None = None
        self._rng_state: torch.Tensor | None = None  # the training stream of torch's generator (LoRA dropout)
        self.merged = False  # set once the LoRA is merged into the weights (`adapt_base`'s merged folder)

    def restore(self, merged: bool) -> None:
        """Give the caller's model back: without the LoRA layers unless they were merged, with its parameters'
        requires_grad, its train/eval mode and its config as they came."""
        if self.cfg.method == "lora" and not merged:
            self.model.unload()
        for p, flag in zip(self.base.parameters(), self._grad_flags):
            p.requires_grad_(flag)
        self.base.train(self._was_training)
        if self._tp is not None:
            self.base.config.pretraining_tp = self._tp

    # ------------------------------------------------------------------------------------------------ the model
    def _wrap(self, model: nn.Module) -> nn.Module:
        for p in model.parameters():
            p.requires_grad_(False)
        if self.cfg.method == "full":
            self._frozen = copy.deepcopy(model).eval()
            for p in self.stack.layers.parameters():
                p.requires_grad_(True)
            return model
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise ImportError(
                "adapt-base trains a LoRA with PEFT: pip install 'early-exit-router[adapt]' (or peft), or pass "
                "method='full' (--method full) to fine-tune every layer instead."
            ) from None
        lora = LoraConfig(
            r=self.cfg.lora_rank,
            lora_alpha=self.cfg.lora_alpha,
            lora_dropout=self.cfg.lora_dropout,
            target_modules=lora_targets(self.stack),
            layers_to_transform=self.lora_layers(),
        )
        with torch.random.fork_rng(devices=[]), quiet_peft():
            torch.manual_seed(self.cfg.seed)
            return get_peft_model(model, lora)

    def lora_layers(self) -> list[int] | None:
        """The decoder layers the LoRA adapts (None: every one)."""
        return None

    def teacher(self) -> AbstractContextManager[nn.Module]:
        """Inside: the original model (the LoRA off, or the frozen copy)."""
        if self.cfg.method == "full":
            return nullcontext(self._frozen)
        return _adapter_off(self.model)

    @property
    def bf16(self) -> bool:
        return native_bfloat16(self.stack.device) if self.cfg.bf16 is None else self.cfg.bf16

    def _autocast(self) -> AbstractContextManager[Any]:
        if not self.bf16:
            return nullcontext()
        return torch.autocast(self.stack.device.type, dtype=torch.bfloat16)

    # ------------------------------------------------------------------------------------------------- training
    def learning_rate(self, step: int) -> float:
        warm = max(1, round(self.cfg.warmup_share * self.cfg.max_steps))
        if step < warm:
            return self.cfg.lr * (step + 1) / warm
        done = (step - warm) / max(1, self.cfg.max_steps - warm)
        return self.cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))

    def batch(self, step: int) -> torch.Tensor:
        """(batch, seq_len) the chunks of `step`: a seeded shuffle per pass over the training chunks."""
        per_pass = max(1, len(self.train) // self.cfg.batch_size)
        epoch, slot = divmod(step, per_pass)
        order = torch.randperm(len(self.train), generator=torch.Generator().manual_seed(self.cfg.seed * 1000 + epoch))
        picked = order[slot * self.cfg.batch_size : (slot + 1) * self.cfg.batch_size]
        return self.train[picked].to(self.stack.device)

    def train_step(self, draft: DraftHead) -> dict[str, float]:
        cfg, stack = self.cfg, self.stack
        ids = self.batch(self.step)
        last = stack.num_layers - 1
        with torch.no_grad(), self.teacher() as teacher, self._autocast():
            teacher.eval()
            t_logits = teacher(input_ids=ids, use_cache=False).logits.float()
            t_full = torch.log_softmax(t_logits, dim=-1)
            t_draft = torch.log_softmax(t_logits[..., draft.token_ids], dim=-1) if cfg.draft_vocab_only else t_full
            del t_logits  # (batch, seq, vocab): 200 MB a step at SmolLM2's vocabulary
        exits = curriculum_exits(
            cfg.curriculum, cfg.exit_layers, self.step, cfg.max_steps, cfg.rotation, cfg.gradual_share
        )
        self.model.train()
        with self.taps.tapping(exits, self.rates) as outputs, self._autocast():
            s_last = self.model(input_ids=ids, use_cache=False).logits.float()
        losses = {}
        for e in exits:
            normed = stack.final_norm(outputs[e])
            s_logits = stack.finish_logits(draft(normed)) if cfg.draft_vocab_only else stack.unembed(normed)
            losses[e] = _kl(t_draft, s_logits.float(), ids, cfg.ce_weight, draft.token_ids)
        losses[last] = _kl(t_full, s_last, ids, cfg.ce_weight, None)
        scales = loss_scales(list(losses), stack.num_layers, cfg.loss_scale, cfg.e_scale, cfg.last_weight)
        self.optimise(sum(s * v for s, v in zip(scales.tolist(), losses.values())))
        return {str(layer): float(v.detach()) for layer, v in losses.items()}

    def optimise(self, loss: torch.Tensor) -> None:
        """One optimiser step on `loss` at this step's learning rate; the model back in eval mode."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.optimizer.step()
        self.model.eval()

    def run(
        self, run_steps: int | None = None, run_seconds: float | None = None, progress: bool = True
    ) -> Iterator[dict[str, Any]]:
        """Train from the current step, yielding each step's curve entry; stops at `max_steps`, or after
        `run_steps` steps / `run_seconds` seconds of this call (the state is saved then, and the run resumes)."""
        cfg = self.cfg
        if self.ranking is None:
            with self.teacher() as original:
                self.ranking = ranking_on(original, self.train[: 4 * EVAL_CHUNKS])
        draft = DraftHead(self.stack.lm_head, self.ranking[: cfg.draft_vocab_size].sort().values)
        start, first = time.perf_counter(), self.step
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="adapt-base", disable=not progress)
        # training draws from torch's generator (LoRA dropout) in a stream of its own, saved with the state: the
        # caller's stream is left as it was, and a resumed run draws what an uninterrupted one would
        with torch.random.fork_rng(devices=[]):
            if self._rng_state is None:
                torch.manual_seed(cfg.seed + 2)
            else:
                torch.set_rng_state(self._rng_state)
            yield from self._steps(draft, start, first, run_steps, run_seconds, bar)

    def _steps(
        self, draft: DraftHead, start: float, first: int, run_steps: int | None, run_seconds: float | None, bar: Any
    ) -> Iterator[dict[str, Any]]:
        cfg = self.cfg
        try:
            while self.step < cfg.max_steps:
                if run_steps is not None and self.step - first >= run_steps:
                    break
                if run_seconds is not None and time.perf_counter() - start >= run_seconds:
                    break
                losses = self.train_step(draft)
                self.step += 1
                entry = {"step": self.step, "tokens": self.step * cfg.batch_size * cfg.seq_len, "loss": losses}
                if self.step % cfg.save_every == 0 or self.step == cfg.max_steps:
                    entry["heldout"] = self.heldout_quality(draft)
                self.curve.append(entry)
                if self.step % cfg.save_every == 0:
                    self.seconds += time.perf_counter() - start
                    start = time.perf_counter()
                    self.save_state()
                bar.update(1)
                bar.set_postfix({f"L{k}": f"{v:.3f}" for k, v in losses.items()})
                yield entry
        finally:
            bar.close()
        self.seconds += time.perf_counter() - start
        self.save_state()

    def heldout_quality(self, draft: DraftHead) -> dict[str, Any]:
        """The adapted model against the original on the held-out chunks (the first EVAL_CHUNKS): `compare`."""
        chunks, exits = self.heldout[:EVAL_CHUNKS], self.cfg.exit_layers
        if self._original_figures is None:  # the original does not change: measured once
            with self.teacher() as original:
                self._original_figures = measure(original, exits, chunks, draft)
        return compare(self._original_figures, measure(self.model, exits, chunks, draft))

    # --------------------------------------------------------------------------------------------- resumption
    def trainables(self) -> dict[str, nn.Parameter]:
        """The weights that train, by name (what a saved state holds)."""
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in self.trainables().items()}

    def save_state(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        state = {
            "config": json.dumps(self.cfg.resume_key(), sort_keys=True),
            "step": self.step,
            "seconds": self.seconds,
            "curve": json.dumps(self.curve),
            "weights": self.trainable_state(),
            "optimizer": self.optimizer.state_dict(),
            "ranking": self.ranking,
            "dropout_rng": self.taps.generator.get_state(),
            "rng": torch.get_rng_state(),  # inside `run`: the training stream
            "base_fingerprint": self.base_fingerprint,
        }
        tmp = self.state_dir / "state.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(self.state_dir / "state.pt")  # atomic: an interrupted save keeps the previous state

    def load_state(self) -> bool:
        """Continue from the saved state, if there is one (its settings must be this run's)."""
        path = self.state_dir / "state.pt"
        if not path.is_file():
            return False
        state = torch.load(path, weights_only=True)  # tensors and plain containers only: nothing is unpickled
        mine = json.dumps(self.cfg.resume_key(), sort_keys=True)
        if state["config"] != mine:
            theirs = json.loads(state["config"])
            diff = {k: (theirs.get(k), v) for k, v in json.loads(mine).items() if theirs.get(k) != v}
            raise ValueError(
                f"{self.state_dir} holds a run with other settings (saved, asked): {diff}. Rerun with the saved "
                "settings to continue it, or pass restart=True (--restart) to start over."
            )
        if state["base_fingerprint"] != self.base_fingerprint:
            raise ValueError(
                f"{self.state_dir} holds a run that started from other base weights: continue it on the base model "
                "it started from, loaded afresh (a full fine-tune trains the model it is given), or restart."
            )
        named = self.trainables()
        shapes = {n: tuple(v.shape) for n, v in state["weights"].items()}
        if shapes != {n: tuple(p.shape) for n, p in named.items()}:
            raise ValueError(
                f"{self.state_dir} holds a run that trained other weights (another head at the exit, or none): "
                "continue it with the --model it started from, or restart."
            )
        with torch.no_grad():
            for name, value in state["weights"].items():
                named[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.seconds = int(state["step"]), float(state["seconds"])
        self.curve, self.ranking = json.loads(state["curve"]), state["ranking"]
        self.taps.generator.set_state(state["dropout_rng"])
        self._rng_state = state["rng"]
        return True


@contextmanager
def _adapter_off(model: nn.Module) -> Iterator[nn.Module]:
    with model.disable_adapter():
        yield model


def _kl(
    teacher_logp: torch.Tensor,
    student_logits: torch.Tensor,
    ids: torch.Tensor,
    ce_weight: float,
    vocab_ids: torch.Tensor | None,
) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), plus `ce_weight` x next-token cross-entropy where the next
    token is in the student's vocabulary (`vocab_ids`: a trimmed one; None: all)."""
    student_logp = torch.log_softmax(student_logits, dim=-1)
    positions = teacher_logp.shape[0] * teacher_logp.shape[1]
    loss = nn.functional.kl_div(student_logp, teacher_logp, log_target=True, reduction="sum") / positions
    if ce_weight:
        target = ids[:, 1:]
        if vocab_ids is not None:  # full ids -> positions in the trimmed vocabulary (-100: outside it)
            lookup = torch.full((int(vocab_ids.max()) + 1,), -100, dtype=torch.long, device=ids.device)
            lookup[vocab_ids] = torch.arange(len(vocab_ids), device=ids.device)
            target = torch.where(target <= vocab_ids.max(), lookup[target.clamp(max=int(vocab_ids.max()))], -100)
        if (target != -100).any():  # every target outside a trimmed vocabulary: no cross-entropy this step
            loss = loss + ce_weight * nn.functional.nll_loss(
                student_logp[:, :-1].flatten(0, 1), target.flatten(), ignore_index=-100
            )
    return loss
