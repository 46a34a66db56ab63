"""The tool-call wire formats of --tool-call-parser, one module each, over shared machinery:

  base.py        ToolFormat: writing (call text, prompt block, history), the grammar per
                 tool_choice (xgrammar structural tags), reading (parse), bind per request
  stream.py      CallStream: reading calls from text that arrives in pieces (content, call
                 deltas, the final calls), the Cursor and Block protocol the formats implement
  json_text.py   JSON read incrementally and written back canonically; the call object
  pyliteral.py   Python literals <-> JSON values (ast, never eval)
  pyschema.py    JSON schema -> EBNF of Python keyword arguments (the pythonic grammar)
  hermes.py, llama3.py, qwen3_coder.py, mistral.py, pythonic.py   the formats
parsers/tool_calls.py names them (FORMATS) and is what the rest of the code imports.
"""
