"""Reading runs back from MLflow: every run of an experiment that matches a filter, across result pages."""

from __future__ import annotations

from typing import Any


def search_all(client: Any, experiment_id: str, query: str) -> list[Any]:
    """Every run of the experiment matching `query` (an MLflow filter string), all pages of 1000."""
    runs, token = [], None
    while True:
        page = client.search_runs([experiment_id], filter_string=query, max_results=1000, page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            return runs
