"""Tool calling on the worker: tools and the history's calls in the prompt (`prompt.py`), the
format a model writes calls in (`segments.py`), their arguments while they stream
(`arguments.py`), and one request's output as content and `tool_calls` (`stream.py`).
`calling.py` ties them to a worker's model. What the request asks (`tools`, `tool_choice`, the
constraint of `required` and named calls) is `pd.protocol.tools`'s.

May import: pd.protocol, pd.protocol.tools, partial_json_parser (never torch or the engine).
"""

from pd.worker.tools.calling import PARSERS, ToolCalling
from pd.worker.tools.prompt import template_inputs
from pd.worker.tools.stream import ToolStream

__all__ = ["PARSERS", "ToolCalling", "ToolStream", "template_inputs"]
