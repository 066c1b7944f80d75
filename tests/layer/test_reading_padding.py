"""Reading padding (kvpolicy.layer.padding): from the mask exactly, from positions as far as they tell."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.errors import PaddingError
from kvpolicy.layer.padding import StepMask, is_padded, leading_pads, rows_differ


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """The positions ``generate`` gives a batch with this 2-D mask: pads 0, each row's tokens 0, 1, ..."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def left(pads: int, n: int) -> torch.Tensor:
    return torch.tensor([[0] * pads + [1] * (n - pads)])


def step(mask: torch.Tensor) -> StepMask:
    return StepMask(mask.bool(), not bool(mask.bool().all()))


masks = st.integers(1, 12).flatmap(lambda n: st.lists(st.booleans(), min_size=n, max_size=n))


@settings(max_examples=300, deadline=None)
@given(bits=masks, held=st.integers(0, 3))
def test_the_mask_serves_exactly_pads_before_the_first_token(bits, held):
    mask = torch.tensor([bits])
    n = len(bits)
    first = bits.index(True) if any(bits) else n
    left_padded = all(bits[first:]) and (held == 0 or first == 0)
    if left_padded:
        assert leading_pads(n, [held], None, step(mask)) == [first]
    else:
        with pytest.raises(PaddingError, match=r"row 0: .*padding_side=\"left\""):
            leading_pads(n, [held], None, step(mask))


@settings(max_examples=300, deadline=None)
@given(bits=masks)
def test_positions_read_left_padding_exactly_and_anything_else_is_refused_or_looks_left_padded(bits):
    """Positions as generate gives them: a left-padded row is read exactly; any other row is refused, unless its
    positions are those of a left-padded row (the one case positions cannot tell: a first token followed by
    padding, or a row of padding only)."""
    mask = torch.tensor([bits])
    n = len(bits)
    positions = generate_positions(mask)
    first = bits.index(True) if any(bits) else n
    try:
        (pads,) = leading_pads(n, [0], positions, None)
    except PaddingError as exc:
        assert not (any(bits) and all(bits[first:])), f"left padding refused: {bits}"
        assert "padding_side" in str(exc)
        return
    if any(bits) and all(bits[first:]):
        assert pads == first
    else:
        assert torch.equal(positions, generate_positions(left(pads, n))), (bits, pads)


def test_a_later_chunk_contradicting_the_reading_of_positions_is_refused_naming_the_mask_remedy():
    # a row of 6 pads, then 2 tokens, in chunks of 4: the first chunk reads as 3 pads and one token
    mask = left(6, 8)
    positions = generate_positions(mask)
    assert leading_pads(4, [0], positions[:, :4], None) == [3]
    with pytest.raises(PaddingError, match=r"do not continue its 1 token.*enable_scores.*chunked_prefill"):
        leading_pads(4, [1], positions[:, 4:], None)
    # with the mask, the first chunk is padding only and the second opens with 2 pads
    assert leading_pads(4, [0], None, step(mask[:, :4])) == [4]
    assert leading_pads(4, [0], None, step(mask[:, 4:])) == [2]


def test_an_unpadded_batch_is_told_apart_from_a_padded_one():
    same = torch.arange(5).expand(3, 5)
    assert not is_padded(same, None, 3) and not is_padded(same[:1], None, 3)  # (1, n) broadcasts
    assert not is_padded(same + 7, None, 3)  # positions counted from elsewhere, the same in every row
    assert is_padded(generate_positions(left(2, 5)), None, 1)  # one padded row
    assert is_padded(torch.stack([torch.arange(5), generate_positions(left(1, 5))[0]]), None, 2)
    assert not is_padded(None, None, 2) and not is_padded(torch.zeros(3, 2, 5), None, 2)  # nothing 2-D to read
    full = step(torch.ones(2, 5))
    assert not is_padded(generate_positions(left(2, 5)).expand(2, 5), full, 2)  # the mask decides
    assert is_padded(same[:2], step(torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])), 2)


def test_a_later_step_is_padded_when_its_rows_differ():
    tree = torch.tensor([[5, 6, 6, 7]]).expand(2, 4)  # drafts may repeat positions, the same in every row
    assert not rows_differ(tree, None, 2)
    assert rows_differ(torch.tensor([[5, 6, 7], [3, 4, 5]]), None, 2)
    assert rows_differ(tree, step(torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]])[:, 1:]), 2)
