"""Fidelity to the paper's code: interface.py (its flags and weight names), golden.py (golden numbers it produced),
fidelity.py (`lrattn fidelity`: the table of docs/fidelity.md)."""
