"""What a run tells its reader: the targets it is judged against, the tables, the plot.

A report is the JSON-ready dict ``run_bench`` returns. Everything here reads only that
dict (its ``meta.config`` included), so a kept ``bench.json`` can be re-read, judged
and plotted again. The parts live in rooms of their own: the targets table
(``_targets``), judging (``_judge``), the text (``_tables``), the plot (``_plot``) and
reading figures (``_figures``); this module is their one face.

Example:
    >>> report = {"targets": [
    ...     {"name": "a", "status": "PASS", "value": 0.7, "where": "x"},
    ...     {"name": "b", "status": "MISS", "value": 3.0, "where": "y"}]}
    >>> [t["name"] for t in missed(report)]
    ['b']
"""

from kvxfer.bench._figures import ZERO_OK as ZERO_OK
from kvxfer.bench._figures import iter_figures as iter_figures
from kvxfer.bench._figures import pinned_figures as pinned_figures
from kvxfer.bench._judge import Verdict as Verdict
from kvxfer.bench._judge import evaluate_targets as evaluate_targets
from kvxfer.bench._judge import exit_status as exit_status
from kvxfer.bench._judge import MISS_MEANING as MISS_MEANING
from kvxfer.bench._judge import NOT_JUDGED as NOT_JUDGED
from kvxfer.bench._judge import judged as judged
from kvxfer.bench._judge import missed as missed
from kvxfer.bench._judge import summary as summary
from kvxfer.bench._judge import verdict as verdict
from kvxfer.bench._plot import PANELS as PANELS
from kvxfer.bench._plot import VARIANTS as VARIANTS
from kvxfer.bench._plot import Variant as Variant
from kvxfer.bench._plot import figure as figure
from kvxfer.bench._plot import plot as plot
from kvxfer.bench._tables import format_report as format_report
from kvxfer.bench._tables import target_line as target_line
from kvxfer.bench._targets import TARGET_TABLE as TARGET_TABLE
from kvxfer.bench._targets import Target as Target
from kvxfer.bench._targets import TARGET_BY_FIELD as TARGET_BY_FIELD
from kvxfer.bench._targets import Targets as Targets
from kvxfer.bench._targets import targets_table as targets_table

__all__ = ["Targets", "evaluate_targets", "missed", "ZERO_OK", "iter_figures",
           "format_report", "pinned_figures", "Variant", "VARIANTS", "PANELS", "figure",
           "plot", "Target", "TARGET_TABLE", "TARGET_BY_FIELD", "targets_table", "Verdict",
           "verdict", "summary", "exit_status", "target_line", "MISS_MEANING",
           "NOT_JUDGED", "judged"]
