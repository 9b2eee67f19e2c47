"""Exact match, as an `evaluate` module shipped with hfacc (the hub's copy is unreachable offline).

Load it with ``hfacc.generation.evaluation.load_exact_match()`` or ``evaluate.load(path_to_this_file)``.
"""

import datasets
import evaluate

_DESCRIPTION = "Fraction of predictions equal to their reference after stripping surrounding whitespace."

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of generated strings.
    references: list of reference strings.
    ignore_case: compare case-insensitively (default False).
Returns:
    exact_match: a float in [0, 1].
Examples:
    >>> metric = evaluate.load("hfacc/metrics/exact_match/exact_match.py")
    >>> metric.compute(predictions=["4 ", "five"], references=["4", "6"])
    {'exact_match': 0.5}
"""


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions, references, ignore_case=False):
        if not predictions:
            return {"exact_match": 0.0}

        def norm(s):
            s = s.strip()
            return s.lower() if ignore_case else s

        hits = sum(norm(p) == norm(r) for p, r in zip(predictions, references, strict=True))
        return {"exact_match": hits / len(predictions)}
