"""DFlash chain decoding: draft one block, verify it with one target forward, keep the agreeing prefix.

``block_size=1`` turns this into plain autoregressive decoding with the same bookkeeping,
which the benchmark uses as its baseline.
"""

import time
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from model import DFlashDraftModel, extract_context_feature, sample

DFLASH_STAGE_ORDER = ("prefill", "draft", "verify", "commit")


def cuda_time() -> float:
    # every stage boundary waits for queued kernels, otherwise the wall clock measures launches
    torch.cuda.synchronize()
    return time.perf_counter()


def empty_stage_times(stage_names: tuple[str, ...]) -> dict[str, float]:
    return dict.fromkeys(stage_names, 0.0)


def add_stage_time(stage_times: dict[str, float], stage: str, since: float) -> float:
    """Charge the time since ``since`` to ``stage``; returns now, to chain stages."""
    now = cuda_time()
    stage_times[stage] += now - since
    return now


def finish_output(
    buffer: torch.Tensor, prompt_len: int, limit: int, mask_token_id: int, stops: torch.Tensor | None
) -> torch.Tensor:
    """Drop the unwritten tail (still mask tokens) and anything after the first stop token."""
    row = buffer[0, :limit]
    row = row[row != mask_token_id]
    if stops is not None:
        hits = torch.isin(row[prompt_len:], stops).nonzero()
        if hits.numel() > 0:
            row = row[: prompt_len + int(hits[0, 0]) + 1]
    return row.unsqueeze(0)


@torch.inference_mode()
def dflash_generate(
    model: DFlashDraftModel, target: AutoModelForCausalLM, input_ids: torch.Tensor, mask_token_id: int,
    max_new_tokens: int, block_size: int, stop_token_ids: list[int], temperature: float = 0.0,
) -> SimpleNamespace:
    device = target.device
    uses_draft = block_size > 1
    prompt_len = input_ids.shape[1]
    limit = prompt_len + max_new_tokens

    # pre-filled with the mask token, so that a fresh block reads [committed token, mask, ...]
    output_ids = torch.full((1, limit + block_size), mask_token_id, dtype=torch.long, device=device)
    output_ids[:, :prompt_len] = input_ids
    position_ids = torch.arange(output_ids.shape[1], device=device).unsqueeze(0)
    stops = None if stop_token_ids is None else torch.tensor(stop_token_ids, device=device)

    stage_times = empty_stage_times(DFLASH_STAGE_ORDER)

    past_key_values_target = DynamicCache()
    past_key_values_draft = DynamicCache()

    clock = cuda_time()
    prefill = target(input_ids, position_ids=position_ids[:, :prompt_len], past_key_values=past_key_values_target,
                     use_cache=True, logits_to_keep=1, output_hidden_states=uses_draft)
    output_ids[:, prompt_len] = sample(prefill.logits[:, -1], temperature)
    if uses_draft:
        target_hidden = extract_context_feature(prefill.hidden_states, model.target_layer_ids)
    decode_start = add_stage_time(stage_times, "prefill", clock)
    time_to_first_token = stage_times["prefill"]

    acceptance_lengths: list[int] = []
    round_timestamps: list[float] = []
    start = prompt_len
    while start < limit:
        clock = cuda_time()
        window = slice(start, start + block_size)
        block_output_ids = output_ids[:, window].clone()

        if uses_draft:
            noise_embedding = target.model.embed_tokens(block_output_ids)
            draft_from = past_key_values_draft.get_seq_length()
            draft_hidden = model(
                target_hidden=target_hidden,
                noise_embedding=noise_embedding,
                position_ids=position_ids[:, draft_from : window.stop],
                past_key_values=past_key_values_draft, use_cache=True,
            )
            # only the context K/V is worth keeping; the noise positions are redrawn next round
            past_key_values_draft.crop(start)
            proposal = sample(target.lm_head(draft_hidden[:, 1:, :]), temperature)
            block_output_ids[:, 1:] = proposal
            clock = add_stage_time(stage_times, "draft", clock)

        verify = target(block_output_ids, position_ids=position_ids[:, window], use_cache=True,
                        past_key_values=past_key_values_target, output_hidden_states=uses_draft)
        posterior = sample(verify.logits, temperature)
        clock = add_stage_time(stage_times, "verify", clock)

        # a draft token survives while every earlier one did and it equals the target's choice
        agree = (block_output_ids[:, 1:] == posterior[:, :-1]).long().cumprod(dim=1)
        committed = int(agree.sum()) + 1
        output_ids[:, start : start + committed] = block_output_ids[:, :committed]
        output_ids[:, start + committed] = posterior[:, committed - 1]
        fresh = output_ids[0, start + 1 : start + committed + 1]

        start += committed
        past_key_values_target.crop(start)
        if uses_draft:
            layers_out = extract_context_feature(verify.hidden_states, model.target_layer_ids)
            target_hidden = layers_out[:, :committed]
        add_stage_time(stage_times, "commit", clock)

        acceptance_lengths.append(committed)
        round_timestamps.append(cuda_time() - decode_start)
        if stops is not None and torch.isin(fresh, stops).any():
            break

    output_ids = finish_output(output_ids, prompt_len, limit, mask_token_id, stops)
    generated = output_ids.shape[1] - prompt_len
    elapsed = cuda_time() - decode_start
    return SimpleNamespace(
        output_ids=output_ids.cpu(), num_input_tokens=prompt_len, num_output_tokens=generated,
        time_to_first_token=time_to_first_token, time_per_output_token=elapsed / max(generated, 1),
        acceptance_lengths=acceptance_lengths, decode_rounds=len(acceptance_lengths),
        stage_times=stage_times, round_timestamps=round_timestamps,
    )
