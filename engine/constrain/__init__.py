"""Grammar-constrained decoding (llguidance): JSON schemas and tool-call grammars -> token masks.

    json_schema_grammar(schema, where) / json_object_grammar()   -> Grammar (checked: RequestError names the fault)
    tool_call_grammar(tools, ...)                                   -> Grammar for Hermes-style <tool_call> blocks
    grammar_processor(tokenizer, grammar)                           -> a logits processor masking each step
"""

from engine.constrain.grammar import (Grammar, GrammarProcessor, grammar_processor, json_object_grammar,
                                      json_schema_grammar, lark_grammar, llg_tokenizer)

__all__ = ["Grammar", "GrammarProcessor", "grammar_processor", "json_object_grammar", "json_schema_grammar",
           "lark_grammar", "llg_tokenizer"]
