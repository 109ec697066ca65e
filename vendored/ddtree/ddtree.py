"""DDTree: verify a best-first tree of draft continuations instead of a single chain.

One draft pass gives a distribution for every block position. Those per-position
distributions define an implicit tree (depth d, rank r = the r-th most likely token at
position d); a heap on cumulative log-probability picks the ``budget`` most likely nodes.
The target scores every node in one forward pass under a tree attention mask, the longest
path that agrees with the target's own choices is kept, and the target cache is compacted
down to that path.
"""

import heapq
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from model import DFlashDraftModel, sample, extract_context_feature
from dflash import dflash_generate, cuda_time, empty_stage_times

DDTREE_STAGE_ORDER = ("prefill", "draft", "tree_build", "tree_compile", "verify", "commit")


def build_ddtree_tree(
    draft_logits: torch.Tensor, budget: int
) -> tuple[torch.Tensor, torch.Tensor, list[int], list[dict[int, int]], torch.Tensor]:
    """Pick the ``budget`` most likely nodes of the per-position draft tree.

    Node 0 is the root (the last committed token, not scored here); nodes 1.. are returned
    in the order they were popped, so a parent always has a smaller index than its child.

    Returns ``(node_token_ids, node_depths, parents, child_maps, visibility)``:
    ``parents[i]`` is the parent of node ``i`` (-1 for the root), ``child_maps[i]`` maps a
    token to the child of node ``i`` holding it, and ``visibility[i, j]`` says whether node
    ``i`` may attend to node ``j`` (``j`` is ``i`` or one of its ancestors).
    """
    if draft_logits.dim() == 3:
        draft_logits = draft_logits[0]
    depth_limit = draft_logits.shape[0]
    if budget <= 0 or depth_limit == 0:
        empty = torch.empty(0, dtype=torch.long)
        return empty, empty.clone(), [-1], [{}], torch.ones((1, 1), dtype=torch.bool)

    # no node can use a rank beyond the budget, so only that many candidates per depth matter
    width = min(budget, draft_logits.shape[-1])
    ranked_logprobs, ranked_tokens = torch.log_softmax(draft_logits.float(), dim=-1).topk(width, dim=-1)
    ranked_logprobs = ranked_logprobs.cpu().tolist()
    ranked_tokens = ranked_tokens.cpu().tolist()

    parents = [-1]
    child_maps: list[dict[int, int]] = [{}]
    scores = [0.0]
    tokens: list[int] = []
    depths: list[int] = []

    # entries: (-cumulative log-prob, insertion order for stable ties, depth, rank, parent node)
    frontier: list[tuple[float, int, int, int, int]] = []
    pushed = 0

    def offer(score: float, depth: int, rank: int, parent: int) -> None:
        nonlocal pushed
        heapq.heappush(frontier, (-score, pushed, depth, rank, parent))
        pushed += 1

    offer(ranked_logprobs[0][0], 1, 0, 0)
    while frontier and len(tokens) < budget:
        neg_score, _, depth, rank, parent = heapq.heappop(frontier)
        node = len(parents)
        token = ranked_tokens[depth - 1][rank]
        parents.append(parent)
        child_maps.append({})
        scores.append(-neg_score)
        tokens.append(token)
        depths.append(depth)
        child_maps[parent][token] = node

        # The two successors that can be the next best: the same parent's next-ranked
        # token, and this node's own most likely child.
        if rank + 1 < width:
            offer(scores[parent] + ranked_logprobs[depth - 1][rank + 1], depth, rank + 1, parent)
        if depth < depth_limit:
            offer(scores[node] + ranked_logprobs[depth][0], depth + 1, 0, node)

    size = len(parents)
    visibility = torch.zeros((size, size), dtype=torch.bool)
    visibility[0, 0] = True
    for node in range(1, size):
        visibility[node] = visibility[parents[node]]
        visibility[node, node] = True

    return (
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(depths, dtype=torch.long),
        parents,
        child_maps,
        visibility,
    )


def compile_ddtree_tree(
    root_token_id: torch.Tensor | int, start: int, node_token_ids: torch.Tensor, node_depths: torch.Tensor,
    visibility_cpu: torch.Tensor, past_length: int, dtype: torch.dtype, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turn a tree into target inputs: ids, positions and an additive 4D attention mask.

    Every node sits at ``start + depth`` (siblings share a position), sees the whole
    committed prefix, and among the tree nodes only itself and its ancestors. The mask is
    ``[1, 1, tree_len, past_length + tree_len]`` with 0 for visible and the dtype's
    minimum for hidden, the form transformers passes to the attention kernels unchanged.
    """
    tree_len = node_token_ids.numel() + 1
    root = torch.as_tensor(root_token_id, dtype=torch.long).reshape(1)
    verify_input_ids = torch.cat([root.cpu(), node_token_ids.cpu()]).to(device).unsqueeze(0)
    depth_from_root = torch.cat([torch.zeros(1, dtype=torch.long), node_depths.cpu()])
    verify_position_ids = (depth_from_root + start).to(device).unsqueeze(0)

    hidden = torch.finfo(dtype).min
    attention_mask = torch.full((1, 1, tree_len, past_length + tree_len), hidden, dtype=dtype, device=device)
    attention_mask[..., :past_length] = 0
    tree_block = attention_mask[0, 0, :, past_length:]
    tree_block.masked_fill_(visibility_cpu.to(device), 0)
    return verify_input_ids, verify_position_ids, attention_mask


def follow_verified_tree(child_maps: list[dict[int, int]], posterior: torch.Tensor) -> tuple[list[int], int]:
    """Walk from the root along the target's choices while the tree has a matching child.

    Returns the accepted node indices (root first) and the target's token after the last
    accepted node, which becomes the next round's root.
    """
    choices = posterior.reshape(-1).tolist()
    path = [0]
    token = choices[0]
    while token in child_maps[path[-1]]:
        path.append(child_maps[path[-1]][token])
        token = choices[path[-1]]
    return path, token


def compact_dynamic_cache(past_key_values: DynamicCache, past_length: int, keep_current_indices: list[int]) -> None:
    """Keep only the accepted tree nodes in the target cache, packed right after the prefix."""
    kept = len(keep_current_indices)
    if kept == 0:
        past_key_values.crop(past_length)
        return

    # one index tensor per device (layers may be spread over GPUs)
    rows_by_device: dict[torch.device, torch.Tensor] = {}
    for layer in past_key_values.layers:
        keys = getattr(layer, "keys", None)
        # only layers that store per-token K/V can be compacted
        if keys is None or keys.numel() == 0:
            continue
        rows = rows_by_device.get(keys.device)
        if rows is None:
            rows = torch.tensor(keep_current_indices, dtype=torch.long, device=keys.device) + past_length
            rows_by_device[keys.device] = rows
        for store in (layer.keys, layer.values):
            # gather first: the kept rows may overlap the slots they are copied into
            store[..., past_length : past_length + kept, :] = store.index_select(-2, rows)
    past_key_values.crop(past_length + len(keep_current_indices))


@torch.inference_mode()
def ddtree_generate(
    model: DFlashDraftModel, target: AutoModelForCausalLM, input_ids: torch.Tensor, mask_token_id: int,
    max_new_tokens: int, block_size: int, stop_token_ids: list[int], temperature: float = 0.0,
    tree_budget: int | None = None,
) -> SimpleNamespace:
    if block_size <= 1:
        # a one-token block has nothing to draft: plain autoregressive decoding
        return dflash_generate(
            model, target, input_ids, mask_token_id, max_new_tokens, block_size, stop_token_ids, temperature
        )

    # with no budget given, the tree gets as many nodes as the chain would have
    budget = block_size - 1 if tree_budget is None else tree_budget
    device = target.device
    prompt_len = input_ids.shape[1]
    limit = prompt_len + max_new_tokens

    # room for the largest possible commit (root + every tree node) past the limit
    output_ids = torch.full((1, limit + budget + 1), mask_token_id, dtype=torch.long, device=device)
    output_ids[:, :prompt_len] = input_ids
    position_ids = torch.arange(limit + block_size, device=device).unsqueeze(0)
    stops = None if stop_token_ids is None else torch.tensor(stop_token_ids, device=device)
    stage_times = empty_stage_times(DDTREE_STAGE_ORDER)

    past_key_values_target = DynamicCache()
    past_key_values_draft = DynamicCache()

    t_begin = cuda_time()
    prefill = target(input_ids, position_ids=position_ids[:, :prompt_len], past_key_values=past_key_values_target,
                     use_cache=True, logits_to_keep=1, output_hidden_states=True)
    output_ids[:, prompt_len] = sample(prefill.logits[:, -1], temperature)
    target_hidden = extract_context_feature(prefill.hidden_states, model.target_layer_ids)
    decode_start = cuda_time()
    time_to_first_token = decode_start - t_begin
    stage_times["prefill"] += time_to_first_token

    acceptance_lengths: list[int] = []
    round_timestamps: list[float] = []
    tree_sizes: list[int] = []
    start = prompt_len
    while start < limit:
        marks = [cuda_time()]
        block_output_ids = torch.full((1, block_size), mask_token_id, dtype=torch.long, device=device)
        block_output_ids[:, 0] = output_ids[:, start]
        noise_embedding = target.model.embed_tokens(block_output_ids)
        draft_from = past_key_values_draft.get_seq_length()
        draft_hidden = model(
            target_hidden=target_hidden,
            noise_embedding=noise_embedding,
            position_ids=position_ids[:, draft_from : start + block_size],
            past_key_values=past_key_values_draft, use_cache=True,
        )
        past_key_values_draft.crop(start)
        # position 0 holds the root, which is already committed: only 1.. are proposals
        per_position_logits = target.lm_head(draft_hidden[0, 1:, :])
        marks.append(cuda_time())

        node_token_ids, node_depths, parents, child_maps, visibility = build_ddtree_tree(per_position_logits, budget)
        marks.append(cuda_time())
        tree_ids, tree_positions, tree_mask = compile_ddtree_tree(
            output_ids[0, start], start, node_token_ids, node_depths, visibility,
            past_length=start, dtype=target.dtype, device=device,
        )
        marks.append(cuda_time())

        verify = target(tree_ids, position_ids=tree_positions, attention_mask=tree_mask, use_cache=True,
                        past_key_values=past_key_values_target, output_hidden_states=True)
        posterior = sample(verify.logits[0], temperature)
        marks.append(cuda_time())

        path, next_token = follow_verified_tree(child_maps, posterior)
        committed = len(path)
        output_ids[0, start : start + committed] = tree_ids[0, path]
        output_ids[0, start + committed] = next_token
        fresh = output_ids[0, start + 1 : start + committed + 1]

        compact_dynamic_cache(past_key_values_target, start, path)
        layers_out = extract_context_feature(verify.hidden_states, model.target_layer_ids)
        target_hidden = layers_out[:, path, :]
        start += committed
        marks.append(cuda_time())

        for stage, (begin, end) in zip(DDTREE_STAGE_ORDER[1:], zip(marks, marks[1:])):
            stage_times[stage] += end - begin
        acceptance_lengths.append(committed)
        tree_sizes.append(len(parents))
        round_timestamps.append(marks[-1] - decode_start)
        if stops is not None and torch.isin(fresh, stops).any():
            break

    # drop the unwritten tail (still mask tokens) and anything after the first stop token
    row = output_ids[0, :limit]
    row = row[row != mask_token_id]
    if stops is not None:
        hits = torch.isin(row[prompt_len:], stops).nonzero()
        if hits.numel() > 0:
            row = row[: prompt_len + int(hits[0, 0]) + 1]

    generated = row.numel() - prompt_len
    elapsed = cuda_time() - decode_start
    return SimpleNamespace(
        output_ids=row.unsqueeze(0).cpu(), num_input_tokens=prompt_len, num_output_tokens=generated,
        time_to_first_token=time_to_first_token, time_per_output_token=elapsed / max(generated, 1),
        acceptance_lengths=acceptance_lengths, decode_rounds=len(acceptance_lengths),
        tree_budget=budget, tree_sizes=tree_sizes, stage_times=stage_times, round_timestamps=round_timestamps,
    )
