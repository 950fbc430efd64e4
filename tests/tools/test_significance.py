"""Welch's t-test (tools/compare/power.py) against scipy's recorded numbers, and the paged run search."""

from __future__ import annotations

import pytest

from lrattn_lightning.tools.compare.power import regularized_beta, student_t_two_sided_p, welch
from lrattn_lightning.tools.compare.runs import search_all

# 2 * scipy.stats.t.sf(t, df), scipy 1.x
T_TABLE = [(2.0, 10, 0.07338803477074037), (1.0, 1, 0.5), (3.5, 4.2, 0.02299374245547738),
           (0.3, 2.5, 0.7873423714951973), (10.0, 30, 4.575251408229618e-11), (2.5, 100.7, 0.014034226596581231)]


@pytest.mark.parametrize("t,df,p", T_TABLE)
def test_student_t_p_matches_scipy(t, df, p):
    assert student_t_two_sided_p(t, df) == pytest.approx(p, rel=1e-10)
    assert student_t_two_sided_p(-t, df) == pytest.approx(p, rel=1e-10)


def test_regularized_beta_closed_forms():
    assert student_t_two_sided_p(0.0, 3) == 1.0
    for x in (0.1, 0.5, 0.9):
        assert regularized_beta(x, 1.0, 1.0) == pytest.approx(x, rel=1e-12)  # uniform
        assert regularized_beta(x, 2.0, 1.0) == pytest.approx(x**2, rel=1e-12)
        assert regularized_beta(x, 0.5, 0.5) + regularized_beta(1 - x, 0.5, 0.5) == pytest.approx(1.0, rel=1e-12)
    with pytest.raises(ValueError):
        student_t_two_sided_p(1.0, 0)


def test_welch_matches_scipy_ttest_ind():
    # scipy.stats.ttest_ind(a, b, equal_var=False).pvalue
    diff, p = welch([1.0, 1.2, 0.9], [1.5, 1.7, 1.4, 1.6])
    assert diff == pytest.approx(-0.5166666666666666) and p == pytest.approx(0.009351860230903826, rel=1e-9)
    assert welch([3.1, 3.05, 3.2, 3.12], [3.0, 3.01, 2.99])[1] == pytest.approx(0.030567900197012637, rel=1e-9)
    assert welch([1.0], [2.0, 3.0]) == (-1.5, None)  # one seed: no test
    assert welch([1.0, 1.0], [1.0, 1.0])[1] == 1.0 and welch([1.0, 1.0], [2.0, 2.0])[1] == 0.0


def test_search_all_reads_every_page():
    class Page(list):
        token = None

    class Client:
        def __init__(self):
            self.calls = []

        def search_runs(self, ids, filter_string, max_results, page_token):
            self.calls.append(page_token)
            page = Page(range(3) if page_token is None else range(3, 5))
            page.token = "next" if page_token is None else None
            return page

    client = Client()
    assert search_all(client, "0", "tags.sweep = 'x'") == [0, 1, 2, 3, 4]
    assert client.calls == [None, "next"]
