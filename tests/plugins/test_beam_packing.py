"""ReDrafter beam dedup and packing (`specpipe::dedup_prefix`, `specpipe::pack_beams`).

The paper's worked example is checked by hand; random beams over a tiny vocab (so prefixes collide
often) are checked against a plain-Python trie, and opcheck covers the op registrations.
"""

from __future__ import annotations

import pytest
import torch

from plugins.beam_packing import PackedBeams, dedup_prefix, pack, unpack, unpacked

EXAMPLE = torch.tensor([[[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]]])  # [1, 3, 4]


def random_beams(b: int, w: int, seq: int, vocab: int, seed: int, shared_root: bool = True) -> torch.Tensor:
    """[B, W, L] beams; the root column is shared per request like real ReDrafter drafts."""
    beams = torch.randint(0, vocab, (b, w, seq), generator=torch.Generator().manual_seed(seed))
    if shared_root:
        beams[:, :, 0] = beams[:, :1, 0]
    return beams


def trie_reference(beams: list[list[int]]) -> tuple[dict[tuple[int, ...], int], list[tuple[int, ...]]]:
    """Per-request trie: prefix -> packed id, ids handed out depth by depth, then by beam index."""
    ids: dict[tuple[int, ...], int] = {}
    prefixes: list[tuple[int, ...]] = []
    for j in range(len(beams[0])):
        for beam in beams:
            prefix = tuple(beam[: j + 1])
            if prefix not in ids:
                ids[prefix] = len(prefixes)
                prefixes.append(prefix)
    return ids, prefixes


def check_against_trie(beams: torch.Tensor, packed: PackedBeams) -> None:
    b, w, seq = beams.shape
    n = w * seq
    assert packed.tokens.shape == packed.parents.shape == packed.depths.shape == (b, n)
    assert packed.tree_mask.shape == (b, n, n) and packed.tree_mask.dtype == torch.bool
    assert packed.unpack_index.shape == (b, w, seq) and packed.num_nodes.shape == (b,)
    # Tokens gathered back to beams reproduce the beams exactly.
    assert torch.equal(unpack(packed.tokens, packed.unpack_index), beams)
    for r in range(b):
        rows = beams[r].tolist()
        ids, prefixes = trie_reference(rows)
        count = len(prefixes)
        assert packed.num_nodes[r].item() == count
        for i in range(w):
            for j in range(seq):
                node = packed.unpack_index[r, i, j].item()
                assert node == ids[tuple(rows[i][: j + 1])]
                assert packed.tokens[r, node].item() == rows[i][j]
                assert packed.depths[r, node].item() == j
        expected_mask = torch.zeros(n, n, dtype=torch.bool)
        for node, prefix in enumerate(prefixes):
            parent = ids[prefix[:-1]] if len(prefix) > 1 else -1
            assert packed.parents[r, node].item() == parent
            assert parent < node  # parents precede children
            for d in range(1, len(prefix) + 1):
                expected_mask[node, ids[prefix[:d]]] = True
        expected_mask[count:, count:] = torch.eye(n - count, dtype=torch.bool)
        assert torch.equal(packed.tree_mask[r], expected_mask)
        assert torch.equal(packed.tokens[r, count:], torch.zeros(n - count, dtype=torch.int64))
        assert torch.equal(packed.parents[r, count:], torch.full((n - count,), -1))
        assert torch.equal(packed.depths[r, count:], torch.zeros(n - count, dtype=torch.int64))


def test_dedup_prefix_paper_example() -> None:
    expected = torch.tensor([[[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 2]]])
    assert torch.equal(dedup_prefix(EXAMPLE), expected)
    assert torch.equal(torch.ops.specpipe.dedup_prefix(EXAMPLE), expected)


def test_pack_beams_paper_example() -> None:
    p = pack(EXAMPLE)
    # Nodes: 0 91 (root) | 1 92 | 2 93 (beam 0), 3 94 (beam 1) | 4 95, 5 96, 6 97; N = 12.
    assert p.num_nodes.tolist() == [7]
    assert p.tokens.tolist() == [[91, 92, 93, 94, 95, 96, 97, 0, 0, 0, 0, 0]]
    assert p.parents.tolist() == [[-1, 0, 1, 1, 2, 3, 2, -1, -1, -1, -1, -1]]
    assert p.depths.tolist() == [[0, 1, 2, 2, 3, 3, 3, 0, 0, 0, 0, 0]]
    assert p.unpack_index.tolist() == [[[0, 1, 2, 4], [0, 1, 3, 5], [0, 1, 2, 6]]]
    sees = [{0}, {0, 1}, {0, 1, 2}, {0, 1, 3}, {0, 1, 2, 4}, {0, 1, 3, 5}, {0, 1, 2, 6}]
    sees += [{k} for k in range(7, 12)]
    expected = torch.zeros(1, 12, 12, dtype=torch.bool)
    for row, cols in enumerate(sees):
        expected[0, row, sorted(cols)] = True
    assert torch.equal(p.tree_mask, expected)


@pytest.mark.parametrize(
    ("b", "w", "seq", "vocab"),
    [(1, 1, 1, 3), (2, 1, 5, 3), (3, 4, 1, 3), (2, 7, 5, 3), (4, 3, 4, 4), (2, 8, 6, 2), (3, 5, 3, 4)],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_dedup_and_pack_match_trie(b: int, w: int, seq: int, vocab: int, seed: int) -> None:
    beams = random_beams(b, w, seq, vocab, seed)
    prefix_tree = dedup_prefix(beams)
    for r in range(b):
        rows = beams[r].tolist()
        for i in range(w):
            for j in range(seq):
                first = min(k for k in range(w) if rows[k][: j + 1] == rows[i][: j + 1])
                assert prefix_tree[r, i, j].item() == first
    packed = pack(beams)
    check_against_trie(beams, packed)
    # All beams share column 0, so node 0 is the single root.
    assert (packed.parents[:, 0] == -1).all() and (packed.depths[:, 0] == 0).all()
    assert ((packed.parents[:, 1:] == -1) == (torch.arange(1, w * seq) >= packed.num_nodes[:, None])).all()


def test_distinct_roots_give_a_forest() -> None:
    beams = random_beams(3, 6, 4, 3, seed=5, shared_root=False)
    assert (beams[:, :, 0] != beams[:, :1, 0]).any()  # the case is exercised
    check_against_trie(beams, pack(beams))


def test_batch_padding_with_different_node_counts() -> None:
    same = torch.tensor([[5, 6, 7]] * 4)  # 3 nodes: every beam identical
    split = torch.tensor([[5, 1, 2], [5, 1, 3], [5, 2, 2], [5, 3, 3]])  # 1 + 3 + 4 = 8 nodes
    distinct = torch.tensor([[1, 1, 1], [2, 2, 2], [3, 3, 3], [4, 4, 4]])  # 12 nodes: no padding
    beams = torch.stack([same, split, distinct])  # [3, 4, 3]
    p = pack(beams)
    assert p.num_nodes.tolist() == [3, 8, 12]
    check_against_trie(beams, p)
    n = 12
    for r, count in enumerate(p.num_nodes.tolist()):
        assert not p.tree_mask[r, :count, count:].any()  # no real node sees padding
        assert not p.tree_mask[r, count:, :count].any()  # padding sees no real node
        assert torch.equal(p.tree_mask[r, count:, count:], torch.eye(n - count, dtype=torch.bool))
    # Attention under the mask stays finite for every row, padding included.
    scores = torch.randn(3, n, n).masked_fill(~p.tree_mask, float("-inf"))
    assert torch.isfinite(torch.softmax(scores, dim=-1)).all()


def test_unpack_gathers_node_values_to_beams() -> None:
    p = pack(EXAMPLE)
    logits = torch.randn(1, 12, 5)  # [B, N, V]
    per_beam = unpack(logits, p.unpack_index)  # [B, W, L, V]
    assert per_beam.shape == (1, 3, 4, 5)
    assert torch.equal(per_beam[0, 2, 3], logits[0, 6])
    assert torch.equal(per_beam[0, 1, 1], logits[0, 1])


def test_unpacked_keeps_every_beam_apart() -> None:
    """Packing off (the paper's ablation): one shared root, then each beam's drafts as its own
    chain, duplicates included; every node sees the root and its own beam up to itself, and
    `unpack` still maps (beam, depth) to the node holding that beam's token."""
    p = unpacked(EXAMPLE)  # [1, 3, 4]: 1 + 3 * 3 nodes where packing keeps 7
    assert p.num_nodes.tolist() == [10] and pack(EXAMPLE).num_nodes.tolist() == [7]
    assert p.tokens.tolist() == [[91, 92, 93, 95, 92, 94, 96, 92, 93, 97, 0, 0]]  # padded to W * L like pack
    assert p.parents.tolist() == [[-1, 0, 1, 2, 0, 4, 5, 0, 7, 8, -1, -1]]
    assert p.depths.tolist() == [[0, 1, 2, 3, 1, 2, 3, 1, 2, 3, 0, 0]]
    ancestors = torch.eye(12, dtype=torch.bool)
    for node, parent in enumerate(p.parents[0].tolist()):
        if parent >= 0:
            ancestors[node] |= ancestors[parent]
    assert torch.equal(p.tree_mask[0], ancestors)  # padding sees only itself
    assert torch.equal(unpack(p.tokens[..., None], p.unpack_index)[..., 0], EXAMPLE)


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="int64"):
        pack(EXAMPLE.to(torch.int32))
    with pytest.raises(ValueError, match=r"\[B, W, L\]"):
        dedup_prefix(EXAMPLE[0])


@pytest.mark.parametrize(
    "beams",
    [EXAMPLE, random_beams(2, 7, 5, 3, seed=3), random_beams(3, 1, 1, 3, seed=4), random_beams(2, 4, 3, 2, seed=6)],
    ids=["example", "w7l5", "w1l1", "w4l3"],
)
def test_opcheck(beams: torch.Tensor) -> None:
    torch.library.opcheck(torch.ops.specpipe.dedup_prefix.default, (beams,))
    torch.library.opcheck(torch.ops.specpipe.pack_beams.default, (beams,))


@pytest.mark.parametrize(("b", "seq"), [(1, 1), (1, 5), (3, 4)])
def test_one_beam_chain_equals_the_op(b: int, seq: int) -> None:
    """`pack` builds a single beam's chain directly: every output equals `specpipe::pack_beams`'s."""
    beams = random_beams(b, 1, seq, 5, seed=seq)
    fast, op = pack(beams), PackedBeams(*torch.ops.specpipe.pack_beams(beams))
    for name, got, want in zip(PackedBeams._fields, fast, op, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want), name
    check_against_trie(beams, fast)
