"""The public API in a few lines: load, generate in both modes, compare with the plain model, save and reload.

python examples/basic.py
"""

from __future__ import annotations

import tempfile

import torch

from early_exit_router import EarlyExitRouter

router = EarlyExitRouter.from_pretrained("smollm2-135m")  # the default model, offline, with its shipped heads
print(router.describe())
input_ids = router.encode("Write the numbers from one to ten, separated by commas.", chat=True)

# verify mode: exited tokens are drafts the deep layers check, so greedy output is the full model's own.
out = router.generate(input_ids, max_new_tokens=48, mode="verify")
print(router.tokenizer.decode(out.sequences[0, input_ids.shape[1] :], skip_special_tokens=True))
print(out.stats.summary())

# The plain model, for comparison: inside disabled() nothing of the patch is left on it.
with router.disabled() as model:
    reference = model.generate(input_ids, max_new_tokens=48, do_sample=False)
print("verify mode identical to plain greedy:", torch.equal(out.sequences, reference))

# exit mode: exited tokens are final (faster, lossy); statistics say how often the deep layers agreed.
out = router.generate(input_ids, max_new_tokens=48, mode="exit")
print(out.stats.summary())

with tempfile.TemporaryDirectory() as folder:
    router.save_pretrained(folder)  # early_exit_config.json + early_exit_heads.safetensors
    model = router.unpatch()  # the original model object, untouched
    reloaded = EarlyExitRouter.from_pretrained(folder)  # loads its base model again, checks it matches
    again = reloaded.generate(input_ids, max_new_tokens=48, mode="exit")
    print("reloaded router gives the same tokens:", torch.equal(again.sequences, out.sequences))
