"""``document_qa``: natural-language passages of generated facts about named things, shared by a
leader and children that each ask one question with a known short answer (seed §24's shape on a real
model).

Every passage is about one invented thing (a city, a company, a ship, a scientist): "The city of
Varnholm lies on the river Oster. It has 3 bridges. Its mayor is Ilse Brandt. ..." A child's prompt,
in the model's chat template, holds every passage in its own shuffled order, with unshared filler
passages (facts about other things) between them, then the question, and opens the assistant's turn;
it is padded to ``prompt_tokens`` with filler. Everything follows from ``seed``.
"""

from __future__ import annotations

import random

from .spec import ChildSpec, SegmentRef, Workload, WorkloadError

_SYLLABLES = ["var", "nor", "kel", "bran", "tor", "mis", "ost", "lin", "dar", "fel", "gor", "hal", "ris", "sel",
              "tam", "vel", "wen", "bel", "cor", "dun", "mar", "pel", "quin", "rad", "sor", "tir", "ul", "zen"]
_ENDINGS = ["holm", "burg", "ford", "vik", "stad", "mere", "ton", "wick", "dal", "gard", "ness", "by"]
_FIRST = ["Ilse", "Marta", "Jonas", "Pieter", "Anika", "Tomas", "Greta", "Lukas", "Sofia", "Henrik", "Clara", "Emil",
          "Freya", "Oskar", "Nina", "Viktor", "Elena", "Felix", "Hanna", "Karl", "Lena", "Mats", "Rosa", "Sven"]
_LAST = ["Brandt", "Olsen", "Weber", "Novak", "Lindqvist", "Moreau", "Keller", "Berg", "Hansen", "Richter",
         "Dahl", "Fischer", "Lund", "Meyer", "Strand", "Vogel", "Wolff", "Holm", "Krause", "Nyberg"]
_GOODS = ["copper", "wool", "salt", "timber", "glass", "cheese", "paper", "silver", "tea", "iron", "honey", "rope"]
_COLORS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple", "grey", "brown"]
_ANIMALS = ["fox", "owl", "horse", "bear", "wolf", "heron", "cat", "goat", "hare", "swan", "otter", "crow"]
_PRODUCTS = ["bicycles", "lamps", "pianos", "clocks", "boots", "umbrellas", "kettles", "maps", "radios", "chairs"]
_FIELDS = ["volcanoes", "bees", "glaciers", "comets", "mosses", "tides", "caves", "storms", "corals", "fungi"]
_FOODS = ["soup", "pancakes", "rice", "apples", "bread", "plums", "fish", "noodles", "beans", "cake"]
_INSTRUMENTS = ["violin", "flute", "drum", "harp", "cello", "trumpet", "guitar", "organ"]
_CARGO = ["coal", "grain", "oranges", "marble", "coffee", "cotton", "oil", "bricks", "sugar", "furs"]
_SPORTS = ["chess", "rowing", "tennis", "fencing", "skiing", "sailing", "archery", "cycling"]


def _name(rng: random.Random) -> str:
    n = rng.choice(_SYLLABLES) + rng.choice(_SYLLABLES[:14]) + rng.choice(_ENDINGS)
    return n[0].upper() + n[1:]


def _person(rng: random.Random) -> str:
    return f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"


def _city_facts(rng, name):
    river, mayor, year = _name(rng), _person(rng), str(rng.randint(1100, 1900))
    k, good, pop = str(rng.randint(2, 9)), rng.choice(_GOODS), str(rng.randint(2, 90) * 1000)
    color, animal, sport = rng.choice(_COLORS), rng.choice(_ANIMALS), rng.choice(_SPORTS)
    return f"The city of {name}", [
        (f"The city of {name} lies on the river {river}.", f"On which river does {name} lie?", river),
        (f"{name} has {k} bridges.", f"How many bridges does {name} have?", k),
        (f"Its mayor is {mayor}.", f"Who is the mayor of {name}?", mayor),
        (f"{name} was founded in {year}.", f"In which year was {name} founded?", year),
        (f"Its main export is {good}.", f"What is the main export of {name}?", good),
        (f"About {pop} people live in {name}.", f"How many people live in {name}?", pop),
        (f"The flag of {name} shows a {color} {animal}.", f"Which animal is on the flag of {name}?", animal),
        (f"The favourite sport in {name} is {sport}.", f"What is the favourite sport in {name}?", sport),
        (f"Its oldest building is a {color} tower.", None, None),
        ("The winters there are long and cold.", None, None),
        ("Its market opens every Tuesday.", None, None),
    ]


def _company_facts(rng, name):
    product, founder, year = rng.choice(_PRODUCTS), _person(rng), str(rng.randint(1850, 2010))
    city, k = _name(rng), str(rng.randint(20, 900))
    color, animal = rng.choice(_COLORS), rng.choice(_ANIMALS)
    return f"The company {name}", [
        (f"The company {name} makes {product}.", f"What does the company {name} make?", product),
        (f"It was founded by {founder}.", f"Who founded the company {name}?", founder),
        (f"{name} was started in {year}.", f"In which year was {name} started?", year),
        (f"Its offices are in the town of {city}.", f"In which town are the offices of {name}?", city),
        (f"{name} employs {k} people.", f"How many people does {name} employ?", k),
        (f"The logo of {name} is a {color} {animal}.", f"Which animal is in the logo of {name}?", animal),
        (f"Its best seller is painted {color}.", f"What colour is the best seller of {name}?", color),
        ("The workers start early in the morning.", None, None),
        ("It sells most of its goods abroad.", None, None),
        ("Its first shop was very small.", None, None),
    ]


def _ship_facts(rng, name):
    year, captain, cargo = str(rng.randint(1700, 1990)), _person(rng), rng.choice(_CARGO)
    k, port, color = str(rng.randint(1, 5)), _name(rng), rng.choice(_COLORS)
    crew = str(rng.randint(8, 120))
    return f"The ship {name}", [
        (f"The ship {name} was built in {year}.", f"In which year was the ship {name} built?", year),
        (f"Its captain is {captain}.", f"Who is the captain of the ship {name}?", captain),
        (f"The {name} carries {cargo}.", f"What does the ship {name} carry?", cargo),
        (f"It has {k} masts.", f"How many masts does the ship {name} have?", k),
        (f"Its home port is {port}.", f"What is the home port of the ship {name}?", port),
        (f"The hull of the {name} is painted {color}.", f"What colour is the hull of the ship {name}?", color),
        (f"A crew of {crew} sailors works on board.", f"How many sailors work on the ship {name}?", crew),
        ("It sails south every spring.", None, None),
        ("The deck is made of oak.", None, None),
        ("It once survived a great storm.", None, None),
    ]


def _scientist_facts(rng, name):
    person = f"{rng.choice(_FIRST)} {name}"
    city, field, food = _name(rng), rng.choice(_FIELDS), rng.choice(_FOODS)
    color, animal, pet = rng.choice(_COLORS), rng.choice(_ANIMALS), _name(rng)
    instrument, year = rng.choice(_INSTRUMENTS), str(rng.randint(1940, 2000))
    return person, [
        (f"{person} is a scientist from {city}.", f"Where is {person} from?", city),
        (f"{person} studies {field}.", f"What does {person} study?", field),
        (f"Her favourite food is {food}.", f"What is the favourite food of {person}?", food),
        (f"She owns a {color} {animal} named {pet}.", f"What is the name of the pet of {person}?", pet),
        (f"{person} plays the {instrument}.", f"Which instrument does {person} play?", instrument),
        (f"{person} was born in {year}.", f"In which year was {person} born?", year),
        (f"Her office door is painted {color}.", None, None),
        ("She writes her notes by hand.", None, None),
        ("She travels by train to her lab.", None, None),
        ("Her students like her lectures.", None, None),
    ]


# sentences true of anything: they bring a passage to its exact length (1 to 12 tokens each)
_NEUTRAL = ["It is well known.", "Many people talk about it.", "Visitors often come in the summer.", "It is old.",
            "Few people know the whole story.", "It appears in several old books.", "Everyone there agrees.",
            "Some of this is written in a small museum guide.", "Nobody remembers why.", "Yes.", "It is true.",
            "Local children learn these facts at school.", "This is often repeated.", "It rains a lot there.",
            "That is all.", "Indeed.", "People are proud of it."]

_KINDS = (_city_facts, _company_facts, _ship_facts, _scientist_facts)


def _passage(tokenizer, rng: random.Random, target: int, kind: int, names: set):
    """(text, token ids, questions) of one passage about a new thing, at most ``target`` tokens
    (exactly ``target`` where the facts allow)."""
    name = _name(rng)
    while name in names:
        name = _name(rng)
    names.add(name)
    _, facts = _KINDS[kind % len(_KINDS)](rng, name)
    first, rest = facts[0], facts[1:]
    rng.shuffle(rest)
    chosen = [first]

    def ids_of(fs):
        return tokenizer.encode(" ".join(f[0] for f in fs), add_special_tokens=False).ids

    for f in rest:
        if len(ids_of(chosen + [f])) <= target:
            chosen.append(f)
    neutral = [(t, None, None) for t in _NEUTRAL]
    rng.shuffle(neutral)
    for f in neutral:  # neutral sentences fill the passage up to the target where they fit
        if len(ids_of(chosen)) == target:
            break
        if len(ids_of(chosen + [f])) <= target:
            chosen.append(f)
    return " ".join(f[0] for f in chosen), ids_of(chosen), [(q, a) for _, q, a in chosen if q is not None]


def _render(model_template, system: str, user: str) -> str:
    if model_template is None:
        return f"{system}\n\n{user}\nAnswer:"
    from kmesh_vllm.model import apply_chat_template

    return apply_chat_template(model_template, [{"role": "system", "content": system},
                                                {"role": "user", "content": user}], add_generation_prompt=True)


def _mark(kind: str, k: int) -> str:
    return f"\ue000{kind}{k}\ue001"  # private-use characters: never in the generated text


def _pieces(rendered: str, marks: list) -> list:
    """The rendered prompt cut at ``marks`` (in order): strings, and the marks' ``(kind, k)`` between."""
    out = []
    for kind, k in marks:
        head, sep, rendered = rendered.partition(_mark(kind, k))
        if not sep:
            raise WorkloadError("chat_template: the template dropped a segment's place from the prompt")
        out += [head, (kind, k)]
    return out + [rendered]


SYSTEM = "You are a helpful assistant."
ASK = " Answer with one word or one number."


def _check_int(name: str, v, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise WorkloadError(f"{name}: expected an int >= {lo}, got {v!r}")


def document_qa(tokenizer, *, chat_template: str | None = None, children: int = 4, segments: int = 4,
                segment_tokens: int = 104, prompt_tokens: int = 512, seed: int = 0) -> Workload:
    """A document-QA workload in the model's chat template (``chat_template``: the model's, or None
    for a plain "...\\nAnswer:" prompt).

    ``segments`` passages of at most ``segment_tokens`` tokens (exactly that where the facts allow)
    are shared as ``doc0``, ``doc1``, ...; the leader holds them all, in order, and asks for a summary.
    Each of ``children`` children (exactly ``prompt_tokens`` tokens) holds them in its own order as
    "Document 1:", "Document 2:", ..., with unshared filler passages in two of the gaps, then asks
    about passage ``i % segments`` (its ``answer`` is known, ``about`` names the passage).
    """
    if tokenizer is None:
        raise WorkloadError("tokenizer: document_qa needs the model's tokenizer (use synthetic() without one)")
    _check_int("children", children, 1)
    _check_int("segments", segments, 1)
    _check_int("segment_tokens", segment_tokens, 16)
    _check_int("prompt_tokens", prompt_tokens, 1)
    rng = random.Random(seed)
    names: set = set()
    passages = [_passage(tokenizer, rng, segment_tokens, k, names) for k in range(segments)]
    seg_names = [f"doc{k}" for k in range(segments)]
    shared = sum(len(p[1]) for p in passages)

    def enc(text: str) -> list:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)

    def parts_of(pieces: list, order: list, fillers: dict) -> list:
        out = []
        for p in pieces:
            if isinstance(p, str):
                if p:
                    out.append(enc(p))
            elif p[0] == "S":
                out.append(SegmentRef(seg_names[order[p[1]]]))
            elif fillers.get(p[1]):
                out.append(fillers[p[1]])
        return out

    docs = "".join(f"Document {i + 1}:\n{_mark('S', i)}\n\n" for i in range(segments))
    marks = [("S", i) for i in range(segments)]
    leader = parts_of(_pieces(_render(chat_template, SYSTEM, f"Here are some documents.\n\n{docs}Summarise them."),
                              marks), list(range(segments)), {})
    newline2 = enc("\n\n")

    specs = []
    for c in range(children):
        about = c % segments
        question, answer = rng.choice(passages[about][2])
        order = list(range(segments))
        rng.shuffle(order)
        user = "Here are some documents.\n\n" + "".join(
            f"{_mark('F', i)}Document {i + 1}:\n{_mark('S', i)}\n\n" for i in range(segments)) + \
            f"{_mark('F', segments)}Question: {question}{ASK}"
        marks = [m for i in range(segments) for m in (("F", i), ("S", i))] + [("F", segments)]
        pieces = _pieces(_render(chat_template, SYSTEM, user), marks)
        fixed = sum(len(enc(p)) for p in pieces if isinstance(p, str) and p) + shared
        need = prompt_tokens - fixed
        if need < 0:
            raise WorkloadError(f"prompt_tokens: {prompt_tokens} is too small; the documents, labels and question "
                                f"of children[{c}] already take {fixed} tokens")
        # unshared filler: facts about other things in two gaps, each ending in a paragraph break
        gaps = sorted(rng.sample(range(segments + 1), k=min(2, segments + 1)))
        split = rng.randint(0, need) if need >= 2 * (len(newline2) + 1) else need
        sizes = [split, need - split] if len(gaps) == 2 else [need]
        fillers = {}
        for gap, size in zip(gaps, sizes):
            ids = []
            while len(ids) < size:
                ids += enc(_passage(tokenizer, rng, segment_tokens, rng.randrange(len(_KINDS)), names)[0]) + newline2
            fillers[gap] = ids[:size - len(newline2)] + newline2 if size > len(newline2) else ids[:size]
        specs.append(ChildSpec(f"child{c}", tuple(parts_of(pieces, order, fillers)), answer, seg_names[about]))
    return Workload({n: tuple(passages[k][1]) for k, n in enumerate(seg_names)}, tuple(leader), tuple(specs))
