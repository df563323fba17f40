"""``check MODEL``'s float64 reference takes the float64 products its transform computed
(:class:`circuitmath._diagnosis._exact.SharedProducts`): only for operands equal entry by entry."""

import torch

from circuitmath._diagnosis._exact import SharedProducts


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(64, 32, generator=g, dtype=torch.float64),
            torch.randn(32, 48, generator=g, dtype=torch.float64))


def test_a_product_of_equal_operands_is_computed_once():
    a, b = _operands()
    with SharedProducts(smallest=1) as products:
        first = a @ b
        again = a.clone() @ b.clone()  # equal values, other tensors
        stacked = torch.matmul(a[None].clone(), b)
    assert again is first and torch.equal(first, a @ b)
    assert len(products.kept) == 2 and torch.equal(stacked[0], first)


def test_other_operands_get_their_own_product():
    """Negative controls: one entry changed, an operand changed in place, float32 operands and a
    product below ``smallest`` are each computed, not taken."""
    a, b = _operands()
    with SharedProducts(smallest=1) as products:
        first = a @ b
        changed = a.clone()
        changed[3, 4] += 1e-12
        assert not torch.equal(changed @ b, first)
        a.mul_(2)  # the kept operand itself, changed after its product
        assert torch.equal(a @ b, 2 * first)
        assert (a.float() @ b.float()) is not None and len(products.kept) == 3
    with SharedProducts(smallest=64 * 32 * 48 + 1) as products:
        a @ b
        assert not products.kept


def test_products_offered_are_taken_in_order_and_dropped_at_the_first_other():
    """A transform that repeats another's products takes them (the same tensors); one that asks
    for another product first drops every offer (control: nothing taken, the offers gone)."""
    a, b = _operands()
    c, d = _operands(seed=1)
    with SharedProducts(smallest=1) as before:
        first, second = a @ b, c @ d
    with SharedProducts(smallest=1, offered=before) as again:
        assert (a.clone() @ b) is first and (c.clone() @ d) is second
    assert len(again.kept) == 2 and not again.offered
    with SharedProducts(smallest=1, offered=before) as other:
        assert (c @ d) is not second  # not the next offered: computed, and the offers dropped
        assert not other.offered and (a @ b) is not first
    offered = SharedProducts(smallest=1, offered=before)
    offered.decline()
    assert not offered.offered
