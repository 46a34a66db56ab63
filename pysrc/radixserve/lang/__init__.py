"""radixserve.lang: the frontend language. Programs written for SGLang run after changing only
the import:

    import radixserve.lang as sgl

    @sgl.function
    def qa(s, question):
        s += sgl.system("You are a helpful assistant.")
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://localhost:30000"))
    print(qa.run(question="What is 2 + 2?")["answer"])

Modules: api (gen, select, roles), program (function, run, run_batch), interpreter (the state
and its executor), backend (RuntimeEndpoint, EngineBackend), choices (select's methods), ir
(the expressions). The chat-template role text is the tokenizer's (radixserve.tokenizer.roles),
shared with the server's /get_model_info.
"""
from radixserve.lang.api import (assistant, assistant_begin, assistant_end, gen, gen_int,
                                 gen_string, image, select, separate_reasoning, system,
                                 system_begin, system_end, user, user_begin, user_end)
from radixserve.lang.backend import Backend, BackendError, EngineBackend, RuntimeEndpoint
from radixserve.lang.choices import (greedy_token_selection, token_length_normalized,
                                     unconditional_likelihood_normalized)
from radixserve.lang.interpreter import ProgramGroup, ProgramState
from radixserve.lang.program import (Program, function, get_default_backend,
                                     set_default_backend)


def flush_cache(backend: Backend = None) -> None:
    """Empty the server's prefix cache (it must be idle)."""
    (backend or get_default_backend()).flush_cache()


def get_server_info(backend: Backend = None) -> dict:
    return (backend or get_default_backend()).get_server_info()


__all__ = ["assistant", "assistant_begin", "assistant_end", "gen", "gen_int", "gen_string",
           "image", "select", "separate_reasoning",
           "system", "system_begin", "system_end", "user", "user_begin",
           "user_end", "Backend", "BackendError", "EngineBackend", "RuntimeEndpoint",
           "greedy_token_selection", "token_length_normalized",
           "unconditional_likelihood_normalized", "ProgramGroup", "ProgramState", "Program",
           "function", "set_default_backend", "get_default_backend", "flush_cache",
           "get_server_info"]
