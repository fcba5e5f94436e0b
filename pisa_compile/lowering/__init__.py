"""FX-graph side: the attention pattern catalogue, the rewrite pass and its report.

- :mod:`.patterns`: named recognisers of the steps of an attention site, in their spellings.
- :mod:`.rewrite`: :func:`rewrite_graph`, the pass the ``pisa`` backend runs.
- :mod:`.report`: :class:`Site`, :class:`Report`, counters and logging.
- :mod:`.explain`: :func:`explain`, the report of a model without compiling it.
"""

from .explain import explain
from .report import Report, Site, record, register_torch_log
from .rewrite import rewrite_graph

__all__ = ["explain", "Report", "Site", "rewrite_graph", "record"]

register_torch_log()
