"""Deterministic generator of English-like text with structure a tiny model can learn.

Documents are short stories with consistent entities (a name, an object with a colour, a place) that end with
questions answered from the story, arithmetic facts, counting and alphabet sequences, days of the week and months,
and single-turn chats ("User: ...\\nAssistant: ..."). The same seed always gives the same documents;
`make_splits` derives each split from its own seed and drops documents already used by an earlier split, so
splits are disjoint.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

NAMES = [
    "Mia", "Tom", "Lily", "Ben", "Anna", "Sam", "Lucy", "Max", "Emma", "Jack", "Zoe", "Leo", "Ella", "Finn",
    "Rosa", "Noah", "Ivy", "Owen", "Nora", "Eli", "Ruby", "Jon", "Kate", "Paul", "Lena", "Hugo", "Maya", "Adam",
    "Sara", "Theo", "Alice", "Oscar", "Clara", "Felix", "Grace", "Henry", "Iris", "Jake", "Luna", "Omar",
    "Peter", "Quinn", "Rita", "Simon", "Tara", "Victor", "Wendy", "Xavier", "Yara", "Zack", "Bella", "Carlos",
    "Daisy", "Elena", "George", "Hannah", "Isaac", "Julia", "Kevin", "Martin", "Nina", "Olivia", "Rachel", "Sophie",
]
OBJECTS = [
    "ball", "kite", "hat", "box", "cup", "book", "bike", "boat", "drum", "bag", "car", "doll", "lamp", "pen",
    "shoe", "coat", "key", "bell", "clock", "spoon", "sock", "train", "scarf", "chair", "shell", "stone",
    "basket", "blanket", "bucket", "candle", "feather", "guitar", "helmet", "jacket", "ladder", "map", "mirror",
    "pencil", "pillow", "ribbon", "robot", "rocket", "rope", "sandwich", "umbrella", "wagon", "whistle", "violin",
]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "pink", "brown", "orange", "purple", "grey"]
PLACES = [
    "park", "beach", "garden", "school", "shop", "farm", "forest", "river", "lake", "hill", "zoo", "library",
    "market", "kitchen", "station", "village", "field", "castle", "bakery", "bridge", "harbour", "island",
    "meadow", "museum", "orchard", "playground", "pond", "valley", "mountain", "cave", "city", "town",
]
ANIMALS = [
    "cat", "dog", "bird", "fish", "horse", "duck", "frog", "rabbit", "mouse", "cow", "sheep", "fox", "goat", "owl",
    "bear", "deer", "hen", "pig", "squirrel", "turtle", "lion", "tiger", "monkey", "snail",
]
FEELINGS = ["happy", "sad", "tired", "hungry", "excited", "calm", "proud", "sleepy", "brave", "curious", "glad",
            "surprised", "worried", "cheerful"]
FOODS = ["apple", "banana", "cake", "bread", "cheese", "soup", "pear", "cookie", "orange", "carrot", "grape",
         "muffin", "pie", "plum", "egg", "peach"]
WEATHER = ["The sun was shining.", "It was raining.", "It was windy.", "It was cold and cloudy.",
           "Snow was falling.", "The sky was clear and blue.", "It was a warm day.", "There was fog everywhere."]
CARRIED = ["took", "carried", "brought"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
    "November", "December",
]
NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
]
LETTERS = [chr(c) for c in range(ord("A"), ord("Z") + 1)]

MIN_CHARS = 200
MAX_CHARS = 800


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _story(rng: random.Random) -> str:
    hero, friend = rng.sample(NAMES, 2)
    obj, friend_obj = rng.sample(OBJECTS, 2)
    colour, friend_colour = rng.sample(COLOURS, 2)
    place = rng.choice(PLACES)
    animal = rng.choice(ANIMALS)
    feeling = rng.choice(FEELINGS)
    day = rng.choice(DAYS)
    food = rng.choice(FOODS)
    lines = [
        f"Once upon a time, there was a child named {hero}. {hero} had {_article(colour)} {colour} {obj}.",
        f"On {day}, {hero} {rng.choice(CARRIED)} the {colour} {obj} to the {place}. {rng.choice(WEATHER)}",
        f"At the {place}, {hero} met {friend}. {friend} had {_article(friend_colour)} {friend_colour} {friend_obj}.",
        rng.choice([
            f'{hero} said, "Can I play with your {friend_colour} {friend_obj}?" {friend} said, "Yes, you can."',
            f'{friend} said, "I like your {colour} {obj}." {hero} said, "Thank you, {friend}."',
        ]),
        f"Then they saw {_article(animal)} {animal} near the {place}. The {animal} was {feeling}.",
        f"{hero} and {friend} shared {_article(food)} {food}.",
        f"At the end of {day}, {hero} went home with the {colour} {obj}. {hero} was {feeling} too.",
    ]
    questions = [
        (f"What colour was the {obj}?", f"The {obj} was {colour}."),
        (f"Where did {hero} go?", f"{hero} went to the {place}."),
        (f"Who did {hero} meet?", f"{hero} met {friend}."),
        (f"What did {friend} have?", f"{friend} had {_article(friend_colour)} {friend_colour} {friend_obj}."),
        ("What day was it?", f"It was {day}."),
        ("What animal did they see?", f"They saw {_article(animal)} {animal}."),
        ("What did they share?", f"They shared {_article(food)} {food}."),
    ]
    asked = rng.sample(questions, rng.randint(1, 3))
    return " ".join(lines) + "\n" + "\n".join(f"Q: {q} A: {a}" for q, a in asked)


def _arithmetic_fact(rng: random.Random) -> str:
    op = rng.choice(["plus", "minus", "times"])
    if op == "plus":
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"{a} plus {b} is {a + b}."
    if op == "minus":
        a = rng.randint(0, 30)
        b = rng.randint(0, a)
        return f"{a} minus {b} is {a - b}."
    a, b = rng.randint(0, 10), rng.randint(0, 10)
    return f"{a} times {b} is {a * b}."


def _arithmetic(rng: random.Random) -> str:
    return " ".join(_arithmetic_fact(rng) for _ in range(rng.randint(4, 9)))


def _counting(rng: random.Random) -> str:
    kind = rng.choice(["up", "down", "step", "words"])
    if kind == "words":
        start = rng.randint(0, 10)
        end = rng.randint(start + 4, 20)
        return f"Counting in words from {NUMBER_WORDS[start]}: " + ", ".join(NUMBER_WORDS[start:end + 1]) + "."
    start = rng.randint(0, 60)
    if kind == "up":
        end = start + rng.randint(5, 20)
        return f"Let us count from {start} to {end}: " + ", ".join(str(i) for i in range(start, end + 1)) + "."
    if kind == "down":
        end = max(0, start - rng.randint(5, 20))
        return f"Let us count down from {start} to {end}: " + ", ".join(
            str(i) for i in range(start, end - 1, -1)) + "."
    step = rng.randint(2, 5)
    values = [start + step * i for i in range(rng.randint(5, 12))]
    return f"Counting by {step} from {start}: " + ", ".join(str(v) for v in values) + "."


def _alphabet(rng: random.Random) -> str:
    kind = rng.choice(["run", "after", "before"])
    if kind == "run":
        start = rng.randint(0, 15)
        end = rng.randint(start + 5, 25)
        return f"The letters from {LETTERS[start]} to {LETTERS[end]} are " + ", ".join(LETTERS[start:end + 1]) + "."
    picks = rng.sample(range(1, 25), rng.randint(3, 6))
    if kind == "after":
        return " ".join(f"After {LETTERS[i]} comes {LETTERS[i + 1]}." for i in picks)
    return " ".join(f"Before {LETTERS[i]} comes {LETTERS[i - 1]}." for i in picks)


def _calendar(rng: random.Random) -> str:
    kind = rng.choice(["week", "today", "months", "next_month"])
    if kind == "week":
        start = rng.randrange(7)
        days = [DAYS[(start + i) % 7] for i in range(rng.randint(4, 10))]
        return "The days go like this: " + ", ".join(days) + "."
    if kind == "today":
        i = rng.randrange(7)
        return f"Today is {DAYS[i]}. Tomorrow is {DAYS[(i + 1) % 7]}. Yesterday was {DAYS[i - 1]}."
    if kind == "months":
        start = rng.randrange(12)
        months = [MONTHS[(start + i) % 12] for i in range(rng.randint(4, 12))]
        return "The months go like this: " + ", ".join(months) + "."
    picks = rng.sample(range(12), rng.randint(2, 4))
    return " ".join(f"The month after {MONTHS[i]} is {MONTHS[(i + 1) % 12]}." for i in picks)


def _chat(rng: random.Random) -> str:
    kind = rng.choice(["sum", "next_day", "count", "story"])
    if kind == "sum":
        a, b = rng.randint(0, 20), rng.randint(1, 9)
        steps = ", ".join(str(a + i) for i in range(1, b + 1))
        return f"User: What is {a} plus {b}?\nAssistant: {a} plus {b} is {a + b}. Count on from {a}: {steps}."
    if kind == "next_day":
        i = rng.randrange(7)
        return f"User: What day comes after {DAYS[i]}?\nAssistant: After {DAYS[i]} comes {DAYS[(i + 1) % 7]}."
    if kind == "count":
        start = rng.randint(0, 30)
        end = start + rng.randint(5, 15)
        numbers = ", ".join(str(i) for i in range(start, end + 1))
        return f"User: Please count from {start} to {end}.\nAssistant: Sure. {numbers}."
    story = _story(rng).split("\n")[0]
    return f"User: Tell me a short story.\nAssistant: {story}"


_SEGMENTS: list[Callable[[random.Random], str]] = [_story, _arithmetic, _counting, _alphabet, _calendar]
_WEIGHTS = [4, 2, 2, 1, 2]


def _document(rng: random.Random) -> str:
    """One document: a chat exchange, or segments of one or more kinds until the target length is reached."""
    if rng.random() < 0.12:
        return _chat(rng)
    target = rng.randint(MIN_CHARS, MAX_CHARS - 150)
    parts: list[str] = []
    length = 0
    while length < target:
        segment = rng.choices(_SEGMENTS, weights=_WEIGHTS)[0](rng)
        if length + len(segment) + 2 > MAX_CHARS:
            if length >= MIN_CHARS:
                break
            continue
        parts.append(segment)
        length += len(segment) + 2
    return "\n\n".join(parts)


def iter_documents(seed: int) -> Iterator[str]:
    """Yield an endless, deterministic stream of documents for `seed` (may repeat a document)."""
    rng = random.Random(seed)
    while True:
        yield _document(rng)


def generate_documents(num: int, seed: int, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Return `num` distinct documents for `seed`, none of them in `exclude`."""
    seen = set(exclude)
    docs: list[str] = []
    for doc in iter_documents(seed):
        if len(docs) == num:
            break
        if doc not in seen:
            seen.add(doc)
            docs.append(doc)
    return docs


def make_splits(sizes: dict[str, int], seed: int) -> dict[str, list[str]]:
    """Generate disjoint splits in the order given; split i uses seed `seed * 1000 + i`."""
    used: set[str] = set()
    splits: dict[str, list[str]] = {}
    for i, (name, num) in enumerate(sizes.items()):
        splits[name] = generate_documents(num, seed * 1000 + i, exclude=used)
        used.update(splits[name])
    return splits
