"""Reading only the cache rows a sparse selection keeps: a decode's cost then follows the selection's size (the
indexer's top-k), not its context length.

A selection is a boolean mask over each request's context (what the lightning indexer returns and what GLM-5's
shared layers reuse). ``selected_positions`` turns it into at most ``width`` context positions per request,
-1 where a request kept fewer; ``gather_selected_rows`` maps those positions through the request's block table
to cache slots and copies just those rows, zeroing the padding ones (a zero row, masked out of the softmax,
cannot carry another request's non-finite values into the sum: see ``engine.layers.paged_attention``).
"""

import torch

from engine.device_batch.attention_metadata import DecodeGroup


def context_table(group: DecodeGroup) -> torch.Tensor:
    """The block table of each request's whole context in position order: [G, S + W] (the group's shared prefix
    blocks first, then its own), as ``paged_attention.decode_context`` lays the context out."""
    if group.shared_blocks is None:
        return group.block_table
    num_reqs = group.block_table.shape[0]
    return torch.cat([group.shared_blocks.expand(num_reqs, -1), group.block_table], dim=1)


def selected_positions(chosen: torch.Tensor, width: int) -> torch.Tensor:
    """chosen [G, L] bool (at most ``width`` True a row) -> positions [G, K] int64, K = min(width, L): each
    row's selected positions (highest first), then -1 where it selected fewer than K.

    A top-K over the positions (-1 where unselected) rather than a sort: linear in L, like the indexer's scoring.
    """
    length = chosen.shape[-1]
    width = max(min(width, length), 1)
    positions = torch.where(chosen, torch.arange(length, device=chosen.device), -1)  # [G, L]
    return positions.topk(width, dim=-1).values  # [G, K]


def gather_selected_rows(cache: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                     torch.Tensor]:
    """The cache rows at ``positions`` of each request's context.

    cache [N_blocks, bs, d]; table [G, W] int64 block ids in context order; positions [G, K] int64 (-1: none)
    -> (rows [G, K, d], a copy with the -1 rows zeroed; valid [G, K] bool).
    """
    block_size = cache.shape[1]
    valid = positions >= 0  # [G, K]
    pos = positions.clamp(min=0)
    slots = table.gather(1, pos // block_size) * block_size + pos % block_size  # [G, K]
    rows = cache.reshape(-1, cache.shape[-1]).index_select(0, slots.reshape(-1)).view(*slots.shape, -1)
    if rows.device.type == "cpu":
        # On the CPU reading the mask costs no synchronisation, and few slots are padding (a prefill's early
        # queries, a decode's short contexts): zero only those rows, not a pass over every gathered row.
        rows[(~valid).nonzero(as_tuple=True)] = 0
    else:
        rows.masked_fill_(~valid[..., None], 0)
    return rows, valid
