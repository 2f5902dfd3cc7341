"""Checkpoints trained to exit through their own head (LayerSkip's): recognised by name and depth, served at their
recommended exit with identity heads, every output the base model's greedy."""

from __future__ import annotations

import pytest
import torch

from early_exit_router.api import EarlyExitRouter
from early_exit_router.config import RouterConfig
from early_exit_router.heads.own_head import own_head_checkpoints, recognise

from .conftest import tiny_llama

LAYERSKIP_1B = "facebook/layerskip-llama3.2-1B"


def layerskip_like(folder):
    """A tiny Llama of the 1B checkpoint's depth (16 layers), saved as the Hub's files are."""
    model = tiny_llama(3, layers=16)
    model.save_pretrained(folder)
    return model


def test_the_table_names_hub_checkpoints_with_exits_inside_their_depth():
    table = own_head_checkpoints()
    assert LAYERSKIP_1B.lower() in table
    for entry in table.values():
        assert entry.hub_name.startswith("facebook/layerskip-") and entry.model_type == "llama"
        assert 0 <= entry.exit_layer < entry.num_hidden_layers - 1


@pytest.mark.parametrize(
    "where", ["layerskip-llama3.2-1B", "hub/models--facebook--layerskip-llama3.2-1B/snapshots/0123abcd"]
)
def test_a_layerskip_folder_is_served_at_its_recommended_exit_through_its_own_head(tmp_path, where):
    """A `--local-dir` named after the checkpoint, or the Hub cache's own layout: exit 3 (transformers'
    assistant_early_exit=4), identity heads counted as trained, and verify mode's output the plain greedy one."""
    folder = tmp_path / where
    model = layerskip_like(folder)
    router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    assert router.exit_layers == [3] and router.config.adapter == "identity"
    assert router.config.heads_trained and router.num_added_parameters() == 0
    assert "UNTRAINED" not in router.describe()
    ids = torch.tensor([[0, 5, 9, 14, 3, 7]])
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=24, do_sample=False)
    assert torch.equal(router.generate(ids, max_new_tokens=24, mode="verify").sequences, expected)


def test_a_loaded_layerskip_model_is_recognised_by_its_config_name(tmp_path):
    """from_model on a model transformers loaded: its config's `_name_or_path` names the checkpoint."""
    folder = tmp_path / "layerskip-llama3.2-1B"
    layerskip_like(folder)
    from transformers import AutoModelForCausalLM

    router = EarlyExitRouter.from_model(AutoModelForCausalLM.from_pretrained(folder))
    assert router.exit_layers == [3] and router.config.heads_trained


def test_the_callers_choices_win_and_a_trained_head_is_not_claimed(tmp_path):
    folder = tmp_path / "layerskip-llama3.2-1B"
    layerskip_like(folder)
    moved = EarlyExitRouter.from_pretrained(folder, warm_up=False, exit_layers=[5])
    assert moved.exit_layers == [5] and moved.config.heads_trained  # still its own head: trained at every layer
    mapped = EarlyExitRouter.from_pretrained(folder, warm_up=False, adapter="postnorm")
    assert mapped.exit_layers == [3] and not mapped.config.heads_trained  # a fresh adapter is untrained
    theirs = EarlyExitRouter.from_pretrained(folder, RouterConfig(exit_layers=[2, 8]), warm_up=False)
    assert theirs.exit_layers == [2, 8] and not theirs.config.heads_trained  # a whole config: taken as given


def test_a_model_named_like_a_checkpoint_but_of_another_depth_gets_fresh_heads_and_a_warning(tmp_path):
    folder = tmp_path / "layerskip-llama3.2-1B"
    tiny_llama(0).save_pretrained(folder)  # 6 layers
    with pytest.warns(UserWarning, match="named like facebook/layerskip-llama3.2-1B but is a llama of 6 layers"):
        router = EarlyExitRouter.from_pretrained(folder, warm_up=False)
    assert router.exit_layers != [3] and not router.config.heads_trained


def test_other_names_are_not_recognised(tmp_path):
    model = tiny_llama(0, layers=16)
    assert recognise(model, [str(tmp_path / "llama3.2-1B"), "meta-llama/Llama-3.2-1B"]) is None
    assert recognise(model, [str(tmp_path / "my-layerskip-llama3.2-1B-finetune")]) is None
