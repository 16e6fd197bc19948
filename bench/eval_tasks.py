"""Two lm-evaluation-harness tasks on local data files (nothing is downloaded): ``kvd_mc`` (multiple choice,
scored by log-likelihood: lm-eval asks for the prompt's log-probabilities) and ``kvd_gen`` (``generate_until``,
greedy, exact match, three examples in each prompt). The questions are built from fixed tables with a fixed seed, so every run asks the same.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "China": "Beijing", "Russia": "Moscow", "Egypt": "Cairo", "Canada": "Ottawa", "Australia": "Canberra",
    "Brazil": "Brasilia", "India": "New Delhi", "Greece": "Athens", "Portugal": "Lisbon", "Norway": "Oslo",
    "Sweden": "Stockholm", "Finland": "Helsinki", "Poland": "Warsaw", "Austria": "Vienna", "Ireland": "Dublin",
    "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago", "Mexico": "Mexico City", "Turkey": "Ankara",
    "Thailand": "Bangkok", "Argentina": "Buenos Aires", "Cuba": "Havana", "Hungary": "Budapest",
    "Denmark": "Copenhagen",
}
OPPOSITES = {
    "hot": "cold", "big": "small", "up": "down", "fast": "slow", "light": "dark", "happy": "sad", "old": "young",
    "open": "closed", "full": "empty", "early": "late", "hard": "soft", "rich": "poor", "strong": "weak",
    "high": "low", "wet": "dry", "long": "short", "loud": "quiet", "thick": "thin", "clean": "dirty",
    "win": "lose",
}
COLORS = {"the sky on a clear day": "blue", "grass": "green", "snow": "white", "coal": "black", "a ripe banana": "yellow",
          "a ripe tomato": "red", "an orange": "orange", "milk": "white", "a lemon": "yellow", "blood": "red"}


def _mc(rng: random.Random) -> list[dict[str, object]]:
    docs: list[dict[str, object]] = []

    def add(question: str, answer: str, pool: list[str]) -> None:
        wrong = rng.sample(sorted(set(pool) - {answer}), 3)
        choices = [answer, *wrong]
        rng.shuffle(choices)
        docs.append({"question": question, "choices": choices, "answer": choices.index(answer)})

    for country, city in CAPITALS.items():
        add(f"What is the capital of {country}?", city, list(CAPITALS.values()))
    for word, opposite in OPPOSITES.items():
        add(f"What is the opposite of '{word}'?", opposite, list(OPPOSITES.values()))
    for thing, color in COLORS.items():
        add(f"What color is {thing}?", color, sorted(set(COLORS.values())))
    for _ in range(40):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        add(f"What is {a} plus {b}?", str(a + b), [str(x) for x in range(2, 41)])
    return docs


def _gen(rng: random.Random) -> list[dict[str, object]]:
    docs: list[dict[str, object]] = [{"question": f"What is the capital of {c}?", "answer": city}
                                     for c, city in CAPITALS.items()]
    docs += [{"question": f"What is the opposite of {w}?", "answer": o} for w, o in OPPOSITES.items()]
    for _ in range(20):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        docs.append({"question": f"What is {a} plus {b}?", "answer": str(a + b)})
    return docs


def _yaml(task: str, data: Path, body: str) -> str:
    return (f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}")


MC_BODY = """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
GEN_BODY = """output_type: generate_until
doc_to_text: "Q: What is the capital of Belgium?\\nA: Brussels\\nQ: What is the opposite of day?\\nA: night\\nQ: What is 2 plus 2?\\nA: 4\\nQ: {{question}}\\nA:"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", "Q:"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
    regexes_to_ignore: ["\\\\s"]
"""


def write_tasks(folder: Path) -> list[str]:
    """The data files and task YAMLs in ``folder`` (an lm-eval include path); returns the task names."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for name, docs, body in (("kvd_mc", _mc(rng), MC_BODY), ("kvd_gen", _gen(rng), GEN_BODY)):
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (folder / f"{name}.yaml").write_text(_yaml(name, data.resolve(), body))
    return ["kvd_mc", "kvd_gen"]
