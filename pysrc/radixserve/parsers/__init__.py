"""Output parsers shared by the server and the frontend language: the chain of thought split from
the answer (reasoning.py, --reasoning-parser) and tool calls in the prompt, their grammar and
their parsing (tool_calls.py, --tool-call-parser). Import the submodules directly."""
