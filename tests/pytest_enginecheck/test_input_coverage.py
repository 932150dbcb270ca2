"""The load check's inputs reach what the engine does (pytest_enginecheck/prompts.py): positions near max_model_len,
decode steps that open a new KV block, one batch of different lengths. Through the zoo session over
zoo.reference_registry, the planted bugs of zoo/planted_inputs.py that only these inputs reach fail load[tp=1] (a
rotary table that ends at position 63, by the reference oracle naming layer 1's attention; a decode path that loses
the token opening a block, by the KV-cache oracle's log-probabilities) and their clean twin passes. Then, on the
real engine, the prompts run as one batch; vLLM's three cross its block size and reach its max_model_len; and, for
any block size, the prompts cross its boundaries and reach max_model_len.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from pytest_enginecheck.prompts import DIAGNOSIS_PROMPT, prompt_lengths, prompt_tokens, special_token_ids
from pytest_enginecheck.targets.engine_ref import kv_consistency, reference
from pytest_enginecheck.targets.engine_ref.tiny_engine import BLOCK_SIZE, MAX_MODEL_LEN, MAX_TOKENS
from tests.zoo_sessions import REFERENCE, ZooSession, zoo_session

ZOO_SESSIONS = {"inputs_session": "reference"}
ITEM = "load[tp=1]"
OLD_LENGTHS = (3, 8, 17)  # the prompts before: neither bug below is reached by them


@pytest.fixture(scope="module")
def inputs_session(tmp_path_factory: pytest.TempPathFactory) -> ZooSession:
    return zoo_session(tmp_path_factory, "reference", *REFERENCE)


def _decode_positions(length: int, max_tokens: int) -> range:
    """The positions of the tokens a prompt of ``length`` feeds back in decode (the last generated one is not)."""
    return range(length, length + max_tokens - 1)


def test_a_rotary_table_that_ends_at_63_fails_load_naming_layer_1s_attention(inputs_session: ZooSession) -> None:
    result = inputs_session.results[("ClampedRopeLlamaForCausalLM", ITEM)]
    assert result["outcome"] == "failed", inputs_session.stdout
    assert result["message"].startswith("ClampedRopeLlamaForCausalLM at tensor_parallel_size=1 does not compute what "
                                        "transformers' LlamaForCausalLM computes"), result["message"]
    detail = result["detail"]
    assert (detail["kind"], detail["module"]) == ("reference_mismatch", "model.layers.1.self_attn")
    assert detail["position"] >= 64 and detail["difference"] > 100 * reference.LOGPROB_TOLERANCE
    assert max(OLD_LENGTHS) + MAX_TOKENS <= 64  # the old prompts never reached a clamped position


def test_a_decode_step_that_opens_a_block_fails_load_by_its_log_probabilities(inputs_session: ZooSession) -> None:
    result = inputs_session.results[("DecodeBlockLlamaForCausalLM", ITEM)]
    assert result["outcome"] == "failed", inputs_session.stdout
    assert result["message"].startswith("DecodeBlockLlamaForCausalLM computes other log-probabilities with the KV "
                                        "cache than recomputing without it, at tensor_parallel_size=1"), \
        result["message"]
    detail = result["detail"]
    assert detail["kind"] == "kv_cache_mismatch" and detail["difference"] > 100 * kv_consistency.LOGPROB_TOLERANCE
    length = prompt_lengths(BLOCK_SIZE, MAX_MODEL_LEN, MAX_TOKENS)[detail["prompt"]]
    position = length + detail["step"] - 1
    assert position % BLOCK_SIZE == 0 and f"its input token at position {position}: KV block " \
        f"{position // BLOCK_SIZE}, slot 0 of {BLOCK_SIZE}, the first slot of a new block" in result["message"]
    # the old prompts never fed a decode token into the first slot of a block
    assert not any(p % BLOCK_SIZE == 0 for n in OLD_LENGTHS for p in _decode_positions(n, MAX_TOKENS))


def test_their_clean_twin_passes_with_both_oracles(inputs_session: ZooSession) -> None:
    result = inputs_session.results[("CleanInputsLlamaForCausalLM", ITEM)]
    assert result["outcome"] == "passed", result["message"]
    detail = result["detail"]
    assert detail["oracle"] == "reference" and detail["kv_cache_equals_recompute"] is True
    assert detail["kv_max_logprob_difference"] < kv_consistency.LOGPROB_TOLERANCE / 10  # float32 rounding only


def test_the_prompts_run_as_one_batch_on_the_engine(tmp_path: Any) -> None:
    """The tiny engine (its options) prefills every prompt in one step, then decodes them all together."""
    from engine_ref.entrypoints.llm import LLM
    from engine_ref.model_executor.model_loader.checkpoint import make_checkpoint
    from pytest_enginecheck.targets.engine_ref.tiny_engine import DEVICE_MEMORY, checkpoint_prompts

    make_checkpoint("LlamaForCausalLM", tmp_path)
    batch = checkpoint_prompts(tmp_path)
    steps: list[list[tuple[int, int]]] = []
    with LLM(str(tmp_path), device_memory=DEVICE_MEMORY, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE) as llm:
        schedule = llm.engine.scheduler.schedule

        def recorded() -> Any:
            output = schedule()
            steps.append([(s.start_position, len(s.token_ids)) for s in output.seqs])
            return output

        llm.engine.scheduler.schedule = recorded
        outputs = llm.generate(batch, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert [len(o) for o in outputs] == [MAX_TOKENS] * len(batch)
    assert steps[0] == [(0, len(p)) for p in batch]
    assert steps[1:] == [[(len(p) + s - 1, 1) for p in batch] for s in range(1, MAX_TOKENS)]


def test_the_tiny_engines_prompts_reach_each_case() -> None:
    lengths = prompt_lengths(BLOCK_SIZE, MAX_MODEL_LEN, MAX_TOKENS)
    assert lengths == [3, 13, 17, 63, 122]
    assert max(lengths) + MAX_TOKENS == MAX_MODEL_LEN  # the last generated token at the last position
    assert lengths[DIAGNOSIS_PROMPT] == BLOCK_SIZE + 1  # the hooked forwards' prompt stays short


def test_the_prompts_avoid_the_ids_a_config_gives_a_role() -> None:
    from engine_ref.model_executor.models.llava import LlavaForConditionalGeneration

    config = LlavaForConditionalGeneration.example_config
    special = special_token_ids(config)
    assert {255, 1, 2} <= special  # image_token_index, and the text config's bos and eos
    vocab = config["text_config"]["vocab_size"]
    for avoid in (special, ()):  # ()): the caller knows only the vocabulary's size
        batch = prompt_tokens(prompt_lengths(BLOCK_SIZE, MAX_MODEL_LEN, MAX_TOKENS), vocab, avoid)
        assert not {t for p in batch for t in p} & special
        assert len({tuple(p[:3]) for p in batch}) == len(batch)  # no two share a prefix


def test_vllms_prompts_cross_its_block_size_and_reach_its_max_model_len() -> None:
    from pytest_enginecheck.targets.vllm.engine import drive
    from pytest_enginecheck.targets.vllm.env import BLOCK_SIZE as VLLM_BLOCK_SIZE
    from pytest_enginecheck.targets.vllm.env import ENGINE_ARGS
    from pytest_enginecheck.targets.vllm.env import MAX_MODEL_LEN as VLLM_MAX_MODEL_LEN

    lengths = [len(p) for p in drive.prompts(256)]
    assert ENGINE_ARGS["block_size"] == VLLM_BLOCK_SIZE < VLLM_MAX_MODEL_LEN  # vLLM's CPU default would be 128
    assert len(lengths) == 3  # the vLLM tier's tests count them
    assert max(lengths) + drive.MAX_TOKENS == VLLM_MAX_MODEL_LEN
    assert any(p % VLLM_BLOCK_SIZE == 0 for n in lengths for p in _decode_positions(n, drive.MAX_TOKENS))
    assert any(n > VLLM_BLOCK_SIZE for n in lengths) and not any(n % VLLM_BLOCK_SIZE == 0 for n in lengths)
    assert sum(lengths) > ENGINE_ARGS["max_num_batched_tokens"]  # vLLM prefills the longest in chunks


@given(block_size=st.integers(1, 300), max_model_len=st.integers(2, 4096), max_tokens=st.integers(1, 16))
@example(block_size=1, max_model_len=3, max_tokens=1)  # every length a multiple of 1: none was left above it (CI)
def test_for_any_block_size_the_prompts_cross_it_and_reach_max_model_len(block_size: int, max_model_len: int,
                                                                          max_tokens: int) -> None:
    if max_tokens >= max_model_len:
        return
    lengths = prompt_lengths(block_size, max_model_len, max_tokens)
    assert all(1 <= n <= max_model_len - max_tokens for n in lengths)
    assert max(lengths) + max_tokens >= max_model_len - 1
    if block_size > 1:
        assert not any(n % block_size == 0 for n in lengths)
    if block_size < max_model_len - max_tokens:  # a prefill can span two blocks
        assert any(n > block_size for n in lengths)
    if max_tokens >= 3 and block_size <= max_model_len - 2:  # a decode step can open a block
        assert any(p % block_size == 0 for n in lengths for p in _decode_positions(n, max_tokens))
    if max_model_len - max_tokens >= 4:
        assert len(set(lengths)) >= 2
