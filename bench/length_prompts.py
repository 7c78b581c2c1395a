"""The length evaluation set's prompts: six kinds of request whose answers differ widely in length.

Templates x topics, seeded, so the same seed writes the same set. Each prompt is one chat
conversation (a list of {"role", "content"} messages) with its kind, which the set also uses as
the tenant: one-word answers, lists, code, essays, extraction from a short document, and chat
(a multi-turn conversation, the last turn the user's). Within a kind the templates ask for more or
less (a word or a sentence, three items or ten, a function or a class), so a kind alone does not
say everything. bench/length_eval_set.py generates the answers with the embedded model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

COUNTRIES = [
    "France", "Japan", "Brazil", "Kenya", "Canada", "Norway", "Egypt", "India", "Mexico", "Spain",
    "Australia", "Chile", "Vietnam", "Poland", "Peru", "Italy", "Germany", "Turkey", "Ghana",
    "Thailand",
]  # fmt: skip
ANIMALS = [
    "dolphin", "penguin", "bat", "shark", "octopus", "eagle", "frog", "whale", "snake", "horse",
    "crocodile", "owl", "spider", "salmon", "elephant",
]  # fmt: skip
TOPICS = [
    "climate change", "the history of the printing press", "remote work", "electric cars",
    "the benefits of reading", "social media and teenagers", "space exploration", "urban gardening",
    "the importance of sleep", "artificial intelligence in medicine", "learning a second language",
    "the Roman Empire", "renewable energy", "public libraries", "video games and education",
    "the ocean's ecosystems", "minimalism", "the invention of the internet", "volunteering",
    "coffee culture",
]  # fmt: skip
THINGS = [
    "fruits that are high in vitamin C", "programming languages", "famous painters",
    "tips for better sleep", "ways to save money", "European capitals", "board games",
    "healthy breakfast ideas", "uses of a paperclip", "reasons to learn to cook",
    "musical instruments",
    "planets in the solar system", "habits of productive people", "common interview questions",
    "houseplants that are easy to care for",
]  # fmt: skip
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the vowels in a string", "merges two sorted lists", "removes duplicates from a list",
    "computes the factorial of n", "finds the largest element of a list",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit",
    "flattens a nested list", "counts word frequencies in a text", "sorts a list with bubble sort",
    "computes the greatest common divisor of two numbers", "parses a date string 'YYYY-MM-DD'",
]  # fmt: skip
LANGUAGES = ["Python", "JavaScript", "C", "Java", "Rust", "Go"]
NAMES = ["Alice Martin", "Bob Chen", "Carla Gomez", "David Okafor", "Emma Schmidt", "Farid Haddad"]
CITIES = [
    "Paris", "Tokyo", "Lisbon", "Nairobi", "Toronto", "Oslo", "Lima", "Rome", "Seoul", "Cairo",
    "Sydney", "Berlin", "Mumbai", "Denver", "Havana",
]  # fmt: skip
PRODUCTS = [
    "laptop", "desk chair", "coffee machine", "bicycle", "headphones", "backpack", "phone",
    "vacuum cleaner", "printer", "kettle",
]  # fmt: skip
HOBBIES = [
    "painting", "running", "chess", "baking", "photography", "guitar", "hiking", "knitting",
    "swimming", "gardening", "yoga", "birdwatching",
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class EvalPrompt:
    """One prompt of the set: its kind (also its tenant) and its conversation."""

    kind: str
    messages: list[dict[str, str]]


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def answer(rng: random.Random) -> list[dict[str, str]]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    country, animal = rng.choice(COUNTRIES), rng.choice(ANIMALS)
    return _user(
        rng.choice(
            [
                f"What is the capital of {country}? Answer with one word.",
                f"Is a {animal} a mammal? Answer yes or no.",
                f"What is {a} plus {b}? Reply with just the number.",
                f"What is {a} times {b}? Give only the result.",
                f"Which continent is {country} in? One word, please.",
                f"Is {a} an even number? Answer with yes or no and one sentence why.",
                f"What is the capital of {country}, and what language is spoken there?",
                f"In one sentence: what does a {animal} eat?",
                "What colour do you get by mixing blue and yellow? One word.",
                f"How many legs does a {animal} have? Just the number.",
            ]
        )
    )


def listing(rng: random.Random) -> list[dict[str, str]]:
    n, things = rng.choice([3, 5, 5, 7, 10]), rng.choice(THINGS)
    return _user(
        rng.choice(
            [
                f"List {n} {things}.",
                f"Give me a numbered list of {n} {things}, one line each.",
                f"Name {n} {things}. Just the names, comma-separated.",
                f"List {n} {things} and explain each one in a sentence or two.",
                f"What are some {things}? Give a bulleted list.",
            ]
        )
    )


def code(rng: random.Random) -> list[dict[str, str]]:
    task, lang = rng.choice(CODE_TASKS), rng.choice(LANGUAGES)
    return _user(
        rng.choice(
            [
                f"Write a {lang} function that {task}.",
                f"Write a {lang} function that {task}. Only the code, no explanation.",
                f"Write a {lang} function that {task}, with comments and an example of its use.",
                f"Write a {lang} function that {task}, then write three unit tests for it.",
                f"Explain step by step how to write a {lang} program that {task}, then show it.",
                f"What is the time complexity of a function that {task}? One line.",
            ]
        )
    )


def essay(rng: random.Random) -> list[dict[str, str]]:
    topic, words = rng.choice(TOPICS), rng.choice([100, 200, 300, 500])
    return _user(
        rng.choice(
            [
                f"Write an essay about {topic}.",
                f"Write a {words}-word essay on {topic}.",
                f"Write a short story that involves {topic}.",
                f"Write a blog post about {topic} with an introduction, three sections and a "
                "conclusion.",
                f"Write one paragraph about {topic}.",
                f"Write a poem about {topic}.",
                f"Summarise the main arguments for and against {topic} in a few sentences.",
            ]
        )
    )


def _document(rng: random.Random) -> tuple[str, str]:
    name, city, product = rng.choice(NAMES), rng.choice(CITIES), rng.choice(PRODUCTS)
    day, month, amount = rng.randint(1, 28), rng.randint(1, 12), rng.randint(20, 2000)
    doc = rng.choice(
        [
            f"Invoice 2024-{month:02d}-{day:02d}. Billed to {name}, {city}. One {product}, "
            f"{amount} EUR, paid by card. Delivery within five working days.",
            f"Dear support, my name is {name} and I live in {city}. On {day}/{month}/2024 I bought "
            f"a {product} for ${amount}, but it stopped working after a week. I would like a "
            "refund or a replacement. Thanks.",
            f"Meeting notes, {day} {['Jan', 'Mar', 'May', 'Sep', 'Nov'][month % 5]}: {name} from "
            f"the {city} office presented the {product} sales figures ({amount} units this "
            "quarter). Next steps: a marketing push and a review in four weeks.",
        ]
    )
    return doc, name


def extraction(rng: random.Random) -> list[dict[str, str]]:
    doc, _ = _document(rng)
    return _user(
        rng.choice(
            [
                f"{doc}\n\nWhat is the person's name? Answer with the name only.",
                f"{doc}\n\nExtract the name, the city, the date and the amount as JSON.",
                f"{doc}\n\nWhich city is mentioned? One word.",
                f"Extract every number from this text, one per line:\n{doc}",
                f"{doc}\n\nSummarise this text in one sentence.",
                f"Read the text and list the key facts as bullet points:\n{doc}",
            ]
        )
    )


def chat(rng: random.Random) -> list[dict[str, str]]:
    city, hobby, product = rng.choice(CITIES), rng.choice(HOBBIES), rng.choice(PRODUCTS)
    opener, reply, follow = rng.choice(
        [
            (
                f"Hi! I'm visiting {city} next month.",
                f"How exciting! {city} has a lot to offer. What would you like to know?",
                rng.choice(
                    [
                        "What should I pack?",
                        "Can you plan a three-day itinerary for me?",
                        "Is it expensive?",
                        "Thanks, that's all!",
                    ]
                ),
            ),
            (
                f"I want to get into {hobby}.",
                f"Great choice! {hobby.capitalize()} is rewarding. Are you a complete beginner?",
                rng.choice(
                    [
                        "Yes, total beginner. Where do I start?",
                        "Yes. What equipment do I need and how much will it cost?",
                        "A little. Any tips?",
                        "Ok, thanks.",
                    ]
                ),
            ),
            (
                f"My new {product} arrived broken.",
                "I'm sorry to hear that. What exactly is wrong with it?",
                rng.choice(
                    [
                        "It doesn't turn on at all. What can I do?",
                        "There's a crack on the side. Write a complaint email for me.",
                        "Never mind, it works now.",
                        "The screen flickers. Is that covered by the warranty?",
                    ]
                ),
            ),
            (
                f"I have chicken, rice and an onion. I'm hungry and in {city}.",
                "Sounds like the start of a good meal! Do you want a recipe or a restaurant?",
                rng.choice(
                    [
                        "A recipe please, with the steps.",
                        "A restaurant. Just one name.",
                        "Something quick, under 20 minutes.",
                    ]
                ),
            ),
        ]
    )
    return [
        {"role": "user", "content": opener},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": follow},
    ]


KINDS = {
    "answer": answer,
    "list": listing,
    "code": code,
    "essay": essay,
    "extract": extraction,
    "chat": chat,
}


def eval_prompts(num: int, seed: int = 0) -> list[EvalPrompt]:
    """num prompts, kinds in equal shares (in turn), distinct conversations only."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    out: list[EvalPrompt] = []
    seen: set[str] = set()
    tries = 0
    while len(out) < num:
        tries += 1
        if tries > 50 * num:
            raise ValueError(f"num: only {len(out)} distinct prompts could be made, not {num}")
        kind = kinds[len(out) % len(kinds)]
        messages = KINDS[kind](rng)
        key = repr(messages)
        if key in seen:
            continue
        seen.add(key)
        out.append(EvalPrompt(kind, messages))
    return out
