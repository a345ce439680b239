"""Writes pd/worker/model/data/quality_mc.json and quality_prompts.json (run once; the files are
what ships). Every item was written for pd by its developers: CC0-1.0."""

import json

LICENCE = "Written for pd by its developers; released under CC0-1.0 (public domain)."

capitals = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("China", "Beijing"),
    ("Russia", "Moscow"),
    ("Egypt", "Cairo"),
    ("the United Kingdom", "London"),
    ("Canada", "Ottawa"),
    ("Australia", "Canberra"),
    ("India", "New Delhi"),
    ("Brazil", "Brasília"),
    ("Mexico", "Mexico City"),
    ("Greece", "Athens"),
    ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"),
    ("Austria", "Vienna"),
    ("Hungary", "Budapest"),
    ("the Czech Republic", "Prague"),
    ("the Netherlands", "Amsterdam"),
    ("Belgium", "Brussels"),
    ("Switzerland", "Bern"),
    ("Turkey", "Ankara"),
    ("Argentina", "Buenos Aires"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Kenya", "Nairobi"),
    ("South Korea", "Seoul"),
    ("Thailand", "Bangkok"),
    ("Vietnam", "Hanoi"),
    ("Indonesia", "Jakarta"),
    ("Cuba", "Havana"),
    ("Iran", "Tehran"),
    ("Iraq", "Baghdad"),
]
opposites = [
    ("hot", "cold"),
    ("big", "small"),
    ("up", "down"),
    ("day", "night"),
    ("fast", "slow"),
    ("happy", "sad"),
    ("open", "closed"),
    ("light", "dark"),
    ("tall", "short"),
    ("wet", "dry"),
    ("early", "late"),
    ("full", "empty"),
    ("hard", "soft"),
    ("loud", "quiet"),
    ("rich", "poor"),
    ("strong", "weak"),
    ("thick", "thin"),
    ("near", "far"),
    ("win", "lose"),
    ("push", "pull"),
    ("buy", "sell"),
    ("clean", "dirty"),
    ("cheap", "expensive"),
    ("begin", "end"),
    ("inside", "outside"),
    ("above", "below"),
    ("true", "false"),
    ("first", "last"),
    ("left", "right"),
    ("north", "south"),
    ("east", "west"),
    ("love", "hate"),
    ("enter", "exit"),
    ("friend", "enemy"),
    ("question", "answer"),
    ("always", "never"),
    ("alive", "dead"),
    ("give", "take"),
    ("remember", "forget"),
    ("accept", "refuse"),
]
days = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
months = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
numbers = [
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
]
colours = [
    ("the sky on a clear day", "blue"),
    ("fresh grass", "green"),
    ("snow", "white"),
    ("coal", "black"),
    ("a ripe banana", "yellow"),
    ("blood", "red"),
    ("milk", "white"),
    ("chocolate", "brown"),
    ("a carrot", "orange"),
    ("a ripe strawberry", "red"),
    ("a lemon", "yellow"),
    ("a cucumber", "green"),
    ("a ripe tomato", "red"),
    ("a crow", "black"),
    ("a polar bear", "white"),
]
colour_words = ["red", "blue", "green", "yellow", "white", "black", "brown", "orange"]
young = [
    ("dog", "puppy"),
    ("cat", "kitten"),
    ("cow", "calf"),
    ("sheep", "lamb"),
    ("horse", "foal"),
    ("duck", "duckling"),
    ("frog", "tadpole"),
    ("bear", "cub"),
    ("goose", "gosling"),
    ("pig", "piglet"),
    ("hen", "chick"),
    ("kangaroo", "joey"),
    ("butterfly", "caterpillar"),
    ("owl", "owlet"),
    ("deer", "fawn"),
]
sounds = [
    ("dog", "barks"),
    ("cat", "meows"),
    ("cow", "moos"),
    ("duck", "quacks"),
    ("lion", "roars"),
    ("sheep", "bleats"),
    ("pig", "oinks"),
    ("horse", "neighs"),
    ("owl", "hoots"),
    ("snake", "hisses"),
    ("bee", "buzzes"),
    ("wolf", "howls"),
    ("frog", "croaks"),
    ("rooster", "crows"),
    ("mouse", "squeaks"),
]
plurals = [
    ("mouse", "mice", ["mouses", "mices", "meese"]),
    ("child", "children", ["childs", "childes", "childrens"]),
    ("foot", "feet", ["foots", "feets", "footes"]),
    ("tooth", "teeth", ["tooths", "teeths", "toothes"]),
    ("man", "men", ["mans", "mens", "manes"]),
    ("woman", "women", ["womans", "womens", "womanes"]),
    ("goose", "geese", ["gooses", "geeses", "goosen"]),
    ("person", "people", ["persons's", "peoples", "personen"]),
    ("leaf", "leaves", ["leafs", "leafes", "leavs"]),
    ("knife", "knives", ["knifes", "knifs", "knive"]),
    ("wolf", "wolves", ["wolfs", "wolfes", "wolvs"]),
    ("box", "boxes", ["boxs", "boxen", "boxies"]),
    ("baby", "babies", ["babys", "babyes", "babis"]),
    ("city", "cities", ["citys", "cityes", "citis"]),
    ("potato", "potatoes", ["potatos", "potatose", "potatoe"]),
    ("half", "halves", ["halfs", "halfes", "halvs"]),
    ("life", "lives", ["lifes", "lifs", "livs"]),
    ("wife", "wives", ["wifes", "wifs", "wivs"]),
    ("ox", "oxen", ["oxes", "oxs", "oxies"]),
    ("louse", "lice", ["louses", "lices", "loice"]),
]

items = []


def add(kind, question, answer, wrong):
    wrong = [w for w in dict.fromkeys(wrong) if w != answer][:3]
    assert len(wrong) == 3, (question, wrong)
    k = len(items) % 4  # the answer's position rotates
    choices = wrong[:k] + [answer] + wrong[k:]
    items.append({"kind": kind, "question": question, "choices": choices, "answer": k})


for i, (country, city) in enumerate(capitals):
    others = [capitals[(i + d) % len(capitals)][1] for d in (7, 13, 29)]
    add("capital", f"What is the capital of {country}?", city, others)
for i, (a, b) in enumerate(opposites):
    others = [opposites[(i + d) % len(opposites)][j] for d, j in ((5, 1), (11, 0), (23, 1))]
    add("opposite", f'What is the opposite of "{a}"?', b, others)


def successors(template: str, ring: list[str], wrong: tuple[int, ...]) -> None:
    """What comes after each member of a ring (days, months); the wrong ones at `wrong` steps."""
    for i, x in enumerate(ring):
        n = len(ring)
        add("sequence", template.format(x), ring[(i + 1) % n], [ring[(i + k) % n] for k in wrong])


successors("Which day of the week comes after {}?", days, (3, 5, 6))
successors("Which month comes after {}?", months, (4, 7, 10))
for i in range(12):
    add(
        "sequence",
        f"What number comes after {numbers[i]}?",
        numbers[i + 1],
        [numbers[(i + k) % 13] for k in (4, 7, 10)],
    )
for i, (thing, c) in enumerate(colours):
    others = [w for w in colour_words if w != c]
    add("colour", f"What colour is {thing}?", c, [others[(i + k) % len(others)] for k in (0, 2, 4)])
for i, (animal, baby) in enumerate(young):
    add(
        "animal",
        f"What is a young {animal} called?",
        baby,
        [young[(i + d) % len(young)][1] for d in (3, 7, 11)],
    )
for i, (animal, s) in enumerate(sounds):
    add(
        "animal",
        f"What does a {animal} do when it makes its sound? It",
        s,
        [sounds[(i + d) % len(sounds)][1] for d in (2, 6, 9)],
    )
for word, plural, wrong in plurals:
    add("plural", f'What is the plural of "{word}"?', plural, wrong)
for a in range(1, 10):
    for b in (2, 3, 5):
        if len([x for x in items if x["kind"] == "arithmetic"]) >= 24:
            break
        s = a + b
        add(
            "arithmetic",
            f"What is {a} plus {b}?",
            str(s),
            [str(s + 1), str(s - 1 if s > 1 else s + 3), str(s + 2)],
        )

prompts = [
    {"kind": "chat", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
]
chat = [
    "Write a haiku about the sea.",
    "Explain how a bicycle works.",
    "List three facts about the moon.",
    "What is photosynthesis?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Describe a walk through a forest in autumn.",
    "What are the primary colours?",
    "How do I boil an egg?",
    "Tell me a short story about a lighthouse keeper.",
    "What is the largest planet in the solar system?",
    "Explain what a computer program is to a child.",
    "What is the difference between weather and climate?",
    "Name three famous painters.",
    "How does a rainbow form?",
    "Write a polite email declining an invitation.",
    "What should I pack for a weekend trip?",
    "What is gravity?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water?",
    "Give me three tips for better sleep.",
    "Who wrote Romeo and Juliet?",
    "What is a prime number?",
    "Summarise the water cycle.",
    "Why do cats purr?",
    "What is the tallest mountain in the world?",
    "How do plants drink water?",
    "Write a limerick about a cat.",
    "What does a firefighter do?",
    "Explain what the internet is.",
    "What is the speed of light?",
    "Suggest a name for a pet goldfish.",
    "How many continents are there?",
    "What is a volcano?",
    "Describe the taste of an orange.",
    "How do airplanes fly?",
    "What is the capital of Japan?",
    "Give me a fun fact about octopuses.",
    "What is recycling and why does it matter?",
]
for c in chat:
    prompts.append({"kind": "chat", "messages": [{"role": "user", "content": c}]})
completion = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "The history of the city of Paris begins",
    "def fibonacci(n):",
    "The three states of matter are",
    "In 1969, the first humans",
    "The best way to learn a language is",
    "Water is made of",
    "The sun rises in the",
    "My favourite season is autumn because",
    "A triangle has",
    "The quick brown fox",
    "To make a cup of tea, first",
    "The largest ocean on Earth is",
    "Dear Sir or Madam,",
    "Photosynthesis is the process by which",
    "import numpy as np\n",
    "The moon orbits the Earth",
    "Bread is made from",
    "The first rule of cooking is",
    "Mount Everest is located in",
    "Elephants are known for",
    "A good night's sleep",
    "The Industrial Revolution began in",
]
for c in completion:
    prompts.append({"kind": "completion", "prompt": c})
assert len(prompts) >= 64, len(prompts)
assert len(items) >= 200, len(items)
json.dump(
    {"licence": LICENCE, "items": items},
    open("pd/worker/model/data/quality_mc.json", "w"),
    indent=0,
    ensure_ascii=False,
)
json.dump(
    {"licence": LICENCE, "prompts": prompts},
    open("pd/worker/model/data/quality_prompts.json", "w"),
    indent=0,
    ensure_ascii=False,
)
print(len(items), len(prompts))
