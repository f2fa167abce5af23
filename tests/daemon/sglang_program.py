"""SGLang front-end programs run against a Kunlun daemon, unchanged: ``python
sglang_program.py BASE_URL`` prints what they produced as one JSON object.

Run in its own process by ``test_sglang_api.py``, with SGLang's front-end on the path (the
Makefile installs it into ``.venv/sglang-frontend``, apart from the platform's packages).
"""

from __future__ import annotations

import json
import sys

import sglang as sgl


@sgl.function
def capital(s, country):  # type: ignore[no-untyped-def]
    s += f"The capital of {country} is" + sgl.gen("city", max_tokens=6, temperature=0)


@sgl.function
def pick(s):  # type: ignore[no-untyped-def]
    s += "The capital of France is"
    s += sgl.select("city", choices=[" Paris", " Rome", " Berlin"])


@sgl.function
def two_steps(s):  # type: ignore[no-untyped-def]
    s += "Q: What is 2+2?\nA:" + sgl.gen("a", max_tokens=4, temperature=0, stop="\n")
    s += "\nQ: What is 3+3?\nA:" + sgl.gen("b", max_tokens=4, temperature=0, stop="\n")


@sgl.function
def chat(s):  # type: ignore[no-untyped-def]
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("answer", max_tokens=8, temperature=0))


def main(base_url: str) -> None:
    backend = sgl.RuntimeEndpoint(base_url)
    # the front-end picks its chat template from model_path, which names no family here;
    # the daemon says which template writes the model's turns
    templated = sgl.RuntimeEndpoint(
        base_url, chat_template_name=backend.model_info["chat_template"]
    )
    talked = chat.run(backend=templated)
    one = capital.run(country="France", backend=backend)
    streamed = capital.run(country="France", stream=True, backend=backend)
    pieces = list(streamed.text_iter("city"))
    batch = capital.run_batch([{"country": c} for c in ("France", "Italy")], backend=backend)
    chosen = pick.run(backend=backend)
    steps = two_steps.run(backend=backend)
    out = {
        "model_path": backend.get_model_name(),
        "gen": one["city"],
        "gen_meta": one.get_meta_info("city"),
        "streamed": "".join(pieces),
        "batch": [state["city"] for state in batch],
        "select": chosen["city"],
        "select_meta": chosen.get_meta_info("city"),
        "steps": [steps["a"], steps["b"]],
        "steps_text": steps.text(),
        "chat_template": backend.model_info["chat_template"],
        "chat_text": talked.text(),
        "chat_answer": talked["answer"],
    }
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
