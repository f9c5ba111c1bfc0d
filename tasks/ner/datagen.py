"""Seeded generator of synthetic English NER data in CoNLL-2003 layout.

The CoNLL-2003 corpus is licensed and cannot ship with the project, yet
the fine-tuning pipeline needs data to run end to end, on every device,
in tests and in CI.  This module writes news-style sentences with the four
CoNLL entity types (PER, ORG, LOC, MISC) from hand-written templates and
name lists.

The data is meant to be learnable but not trivial:

* dozens of templates with different structure: entities at the start and
  end of sentences, multi-token entities, adjacent entities (including two
  adjacent ORGs, which need the B- boundary), sports-result lines,
  headlines without final punctuation, and sentences without entities;
* deliberately ambiguous surface forms, as in real news: "Jordan" and
  "Florence" are first names and places, "Washington" a surname and a city,
  country names appear as LOC inside sentences about sports, and city
  names appear inside ORG names ("Bank of Kenya", "Leeds United");
* for the train/dev split, a seeded part of every name list is held out of
  train, so dev F1 measures generalisation to unseen names rather than
  memorisation.

Tags are IOB2.  All randomness comes from ``random.Random`` seeded with a
string, which is reproducible across runs and platforms (string seeds are
hashed with SHA-512, independent of PYTHONHASHSEED).
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Mapping

from tasks.ner.conll import Sentence, write_conll

__all__ = ["ENTITY_TYPES", "TEMPLATES", "generate", "write_splits"]

ENTITY_TYPES = ("PER", "ORG", "LOC", "MISC")

# --- name lists -------------------------------------------------------------
# Invented or common names; several are intentionally shared across types.

_FIRST_NAMES = (
    "James", "Maria", "Ahmed", "Yuki", "Olga", "Pierre", "Chen", "Fatima",
    "Lars", "Sofia", "Kwame", "Priya", "Diego", "Anna", "Tomasz", "Ingrid",
    "Hiroshi", "Amara", "Mateo", "Elena", "Jordan", "Florence", "Victoria",
    "Samuel", "Leila", "Nikolai", "Grace", "Rafael", "Mei", "Oluwaseun",
    "Henrik", "Aisha", "Marco", "Camille", "Dmitri", "Ruth", "Tariq",
    "Beatriz", "Kenji", "Helena", "Patrick", "Zainab", "Stefan", "Lucia",
    "Ibrahim", "Nadia", "Viktor", "Chloe", "Emeka", "Sven", "Isabel",
    "Arjun", "Greta", "Pablo", "Hana", "Joseph", "Wanjiru", "Felix",
    "Miriam", "Andrei",
)

_LAST_NAMES = (
    "Okafor", "Lindqvist", "Moreau", "Tanaka", "Kowalski", "Fernandes",
    "Washington", "Berg", "Novak", "Haddad", "Mensah", "Petrov", "Santos",
    "Schneider", "Nakamura", "Osei", "Rossi", "Dubois", "Kaplan", "Ivanova",
    "Mwangi", "Larsen", "Costa", "Yilmaz", "Nguyen", "Kimura", "Adeyemi",
    "Hoffmann", "Castillo", "Brennan", "Sato", "Abdi", "Moretti", "Kovacs",
    "Lefebvre", "Chowdhury", "Eriksen", "Vargas", "Keller", "Achebe",
    "Horvath", "Delgado", "Fischer", "Banda", "Jensen", "Romero", "Wagner",
    "Otieno", "Marchetti", "Sokolov", "van Dijk", "de Souza", "El Amrani",
    "da Silva", "Lund", "Ferreira", "Quinn", "Hartmann", "Mbeki", "Duarte",
)

_COMPANIES = (
    "Halcyon Systems", "Northwind Trading", "Bluewater Energy",
    "Kestrel Airlines", "Meridian Bank", "Orion Motors",
    "Sable Pharmaceuticals", "Granite Insurance", "Vantage Media Group",
    "Atlas Steel", "Corvid Software", "Pinecrest Foods", "Larkspur Capital",
    "Tessera Mining", "Aurora Telecom", "Harbourline Shipping",
    "Silverleaf Chemicals", "Cobalt Semiconductors", "Redwood Holdings",
    "Quillon Electronics", "Everstone Cement", "Marlow Brewing",
    "Zephyr Rail", "Brightwell Retail", "Ostrava Glassworks", "Nordhavn",
    "Calloway", "Voltaris",
)

_INSTITUTIONS = (
    "United Nations", "European Union", "World Bank",
    "International Monetary Fund", "Red Cross", "NATO", "Bundesbank",
    "Federal Reserve", "European Commission", "World Health Organisation",
    "Supreme Court", "African Union", "Interpol", "OPEC",
    "World Trade Organisation", "Amnesty International",
)

_TEAMS = (
    "Ajax", "Celtic", "Juventus", "Benfica", "Galatasaray", "Porto",
    "Boca Juniors", "Rangers", "Feyenoord", "Olympiakos", "Sparta Prague",
    "Red Star Belgrade", "Dynamo Kiev", "Anderlecht", "River Plate",
    "Bayern Munich", "Chelsea", "Santos", "Lazio", "Hajduk Split",
)

_COUNTRIES = (
    "Germany", "France", "Brazil", "Japan", "Kenya", "Canada",
    "New Zealand", "South Africa", "United States", "Sri Lanka",
    "Saudi Arabia", "Czech Republic", "Jordan", "Peru", "Norway", "Nigeria",
    "Argentina", "Poland", "Turkey", "Vietnam", "Ghana", "Italy", "Sweden",
    "Egypt", "India", "Chile", "Hungary", "Indonesia", "Portugal",
    "South Korea", "Ireland", "Morocco",
)

_CITIES = (
    "London", "Paris", "Nairobi", "Tokyo", "Rio de Janeiro", "Buenos Aires",
    "New York", "Hong Kong", "Los Angeles", "Cape Town", "Kuala Lumpur",
    "Sao Paulo", "Tel Aviv", "St Petersburg", "Washington", "Florence",
    "Victoria", "Lagos", "Oslo", "Lima", "Hanoi", "Seoul", "Dublin",
    "Warsaw", "Leeds", "Accra", "Istanbul", "Melbourne", "Montreal",
    "Casablanca", "Frankfurt", "Mumbai",
)

_PLACES = (
    "Lake Victoria", "Alps", "Rhine", "Mount Kenya", "Sahara", "Balkans",
    "Gulf of Mexico", "West Bank", "Siberia", "Bavaria", "Patagonia",
    "Kashmir", "Andes", "Mekong Delta", "Black Sea", "Rift Valley",
)

_NATIONALITIES = (
    "German", "French", "Brazilian", "Japanese", "Kenyan", "Canadian",
    "Norwegian", "Nigerian", "Argentine", "Polish", "Turkish", "Vietnamese",
    "Ghanaian", "Italian", "Swedish", "Egyptian", "Indian", "Chilean",
    "Hungarian", "Indonesian", "Portuguese", "Irish", "Moroccan", "Peruvian",
    "Australian", "Dutch",
)

_EVENTS = (
    "World Cup", "Olympic Games", "Tour de France", "Davis Cup",
    "Monaco Grand Prix", "Champions League", "Cannes Film Festival",
    "Winter Olympics", "Asian Games", "Ryder Cup", "Africa Cup of Nations",
    "Commonwealth Games", "Berlin Marathon", "Copa America",
)

_PRODUCTS = (
    "Nimbus 5", "Falcon X2", "Skylark", "Corvid Office", "Atlas 300",
    "Meridian Card", "Orion Starline", "Kestrel 900", "Aurora One",
    "Quillon Pad", "Zephyr Express",
)

_AWARDS = (
    "Nobel Prize", "Golden Globe", "Booker Prize", "Ballon d'Or",
    "Pulitzer Prize", "Palme d'Or", "Fields Medal",
)

_TREATIES = (
    "Kyoto Protocol", "Maastricht Treaty", "Geneva Conventions",
    "Paris Agreement", "Schengen Agreement", "Oslo Accords",
)

_LANGUAGES = (
    "English", "Spanish", "Swahili", "Mandarin", "Arabic", "Portuguese",
    "Hindi", "Bengali", "Yoruba", "Tagalog",
)

_RELIGIONS = (
    "Catholic", "Muslim", "Buddhist", "Protestant", "Hindu", "Jewish",
    "Orthodox", "Sikh",
)

# One entry per holdout-able pool: (name, entity type, names).
_POOLS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("FIRST", "PER", _FIRST_NAMES),
    ("LAST", "PER", _LAST_NAMES),
    ("COMPANY", "ORG", _COMPANIES),
    ("INSTITUTION", "ORG", _INSTITUTIONS),
    ("TEAM", "ORG", _TEAMS),
    ("COUNTRY", "LOC", _COUNTRIES),
    ("CITY", "LOC", _CITIES),
    ("PLACE", "LOC", _PLACES),
    ("NAT", "MISC", _NATIONALITIES),
    ("EVENT", "MISC", _EVENTS),
    ("PRODUCT", "MISC", _PRODUCTS),
    ("AWARD", "MISC", _AWARDS),
    ("TREATY", "MISC", _TREATIES),
    ("LANG", "MISC", _LANGUAGES),
    ("RELIGION", "MISC", _RELIGIONS),
)

_FULL_POOLS: dict[str, tuple[str, ...]] = {name: names for name, _, names in _POOLS}

# Share of every pool kept out of train by write_splits.  A fifth leaves
# train varied enough to learn from while most dev sentences still contain
# at least one name the model has never seen.
_HOLDOUT_FRACTION = 0.2

# --- non-entity fillers (always tagged O) -------------------------------------

_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July",
    "August", "September", "October", "November", "December",
)
_TITLES = (
    "President", "Prime Minister", "Finance Minister", "Foreign Minister",
    "coach", "Senator", "spokesman", "chairman", "Dr.", "Mr.", "Mrs.",
    "General", "Judge",
)
_SAID = ("said", "told reporters", "said in a statement", "added", "told a news conference")

# --- templates ---------------------------------------------------------------
# Tokens are separated by single spaces.  {SLOT}s expand to one or more
# tokens; entity slots are tagged with their type, filler slots with O.

TEMPLATES: tuple[str, ...] = (
    # business
    "{PER} , a spokesman for {ORG} , said the company would cut {NUM} jobs in {LOC} .",
    "{COMPANY} shares rose {PCT} percent in {CITY} on {DAY} .",
    "{COMPANY} said its {MONTH} sales of the {PRODUCT} rose {PCT} percent .",
    "Talks on the {COMPANY_SHORT} {COMPANY_SHORT} merger collapsed on {DAY} .",
    "{COMPANY_SHORT} {COMPANY_SHORT} joint venture wins approval",
    "{ORG} 's chief executive {PER} resigned on {DAY} .",
    "The {PRODUCT} , made by {COMPANY} , goes on sale in {COUNTRY} next {MONTH} .",
    "{ORG} said it had agreed to buy a stake in {COMPANY} for {BIGNUM} dollars .",
    "{COMPANY} , based in {CITY} , makes parts for the {PRODUCT} .",
    "Strike hits {COMPANY}",
    "Analysts at {COMPANY} expect the {INSTITUTION} to raise rates in {MONTH} .",
    "{COUNTRY} 's central bank left interest rates unchanged on {DAY} .",
    "Exports from {COUNTRY} to {COUNTRY} rose {PCT} percent in {MONTH} , the {INSTITUTION} {SAID} .",
    "{PER_LAST} said {COMPANY_SHORT} would not sell its {CITY} plant .",
    # politics and world news
    "The {NAT} government said on {DAY} it would send troops to {COUNTRY} .",
    "{TITLE} {PER} told reporters in {CITY} that talks with {ORG} had stalled .",
    "The {INSTITUTION} called on {COUNTRY} and {COUNTRY} to resume negotiations .",
    "Police in {CITY} arrested {NUM} people after clashes near the {NAT} embassy .",
    "A {NAT} tourist was injured in {CITY} on {DAY} , police said .",
    "In {CITY} , {PER} said {ORG} had no plans to leave {COUNTRY} .",
    "{NUM} people were killed when a bus overturned near {PLACE} , officials in {CITY} said .",
    "Fighting broke out again in {PLACE} on {DAY} , according to the {ORG} .",
    "The {NAT} and {NAT} foreign ministers met in {CITY} on {DAY} .",
    "{PER} , a {NAT} national living in {CITY} , was released on {DAY} .",
    "{PER} flew to {CITY} for talks with {TITLE} {PER} .",
    "Floods kill {NUM} in {COUNTRY}",
    "{NAT} minister to visit {COUNTRY}",
    "{PER} to step down as head of {ORG}",
    "{CITY} {DATE}",
    "{COUNTRY} {SAID} it had expelled {NUM} diplomats from {COUNTRY} .",
    "Officials at the {ORG_COMPOSITE} {SAID} the budget for {YEAR} was approved .",
    "Heavy snow closed roads across the {PLACE} on {DAY} .",
    "The {TREATY} was signed in {CITY} in {YEAR} .",
    "{PER} won the {AWARD} in {YEAR} .",
    "{LANG} is spoken by about {BIGNUM} people in {COUNTRY} .",
    "The {RELIGION} community in {CITY} marked the holiday on {DAY} .",
    "{PER} , {NUM} , was elected mayor of {CITY} .",
    "A court in {CITY} sentenced {PER} to {NUM} years in prison .",
    "Rescue teams searched the slopes of {PLACE} for {NUM} missing climbers .",
    "The {ORG_COMPOSITE} will reopen in {MONTH} , {PER_LAST} {SAID} .",
    # sport
    "{TEAM} beat {TEAM} {SCORE} in the {EVENT} on {DAY} .",
    "{PER} scored twice as {TEAM} drew {SCORE} with {TEAM} .",
    "{TEAM} beat {TEAM}",
    "{NUM} . {PER} ( {COUNTRY} ) {TIME}",
    "{PER} {COUNTRY} {TIME}",
    "{NAT} {PER} won the {NUM}-metre race in {TIME} .",
    "{PER_LAST} , who joined {TEAM} from {TEAM} in {YEAR} , is expected to miss the {EVENT} .",
    "{PER} , the {NAT} champion , will defend the title at the {EVENT} in {CITY} .",
    "{TEAM} coach {PER} said the {EVENT} final would be tough .",
    "{PER} and {PER} will meet in the final of the {EVENT} on {DAY} .",
    "Scorers : {PER_LAST} {NUM} , {PER_LAST} {NUM}",
    "The {EVENT} will be held in {CITY} in {YEAR} .",
    "{CITY} will host the {EVENT} , the {INSTITUTION} announced .",
    "{COUNTRY} beat {COUNTRY} {SCORE} in a friendly in {CITY} .",
    "{PER} , {NUM} , has played for {TEAM} since {YEAR} .",
    "{PER} wins {EVENT}",
    "Asked about the {EVENT} , {PER} said : \" We are ready . \"",
    "{PER} 's {NAT} team-mate finished second in {CITY} .",
    "{TEAM_CITY} signed {NAT} defender {PER} on a {FEW}-year contract .",
    "{PER} ( {TEAM} ) {NUM}",
    "{TEAM} {NUM} {NUM} {NUM} {NUM}",
    # no entities
    "Prices fell {PCT} percent in {MONTH} , the biggest drop in {NUM} years .",
    "The meeting is expected to last {FEW} days .",
    "Shares closed higher on {DAY} after a volatile session .",
    "Rain delayed the start of play by {FEW} hours .",
    "There was no immediate comment from officials .",
    "The two sides will meet again in {MONTH} .",
    "Attendance : {BIGNUM}",
    "Half-time {SCORE}",
    "He said the decision would be announced on {DAY} .",
    "Analysts expect growth of about {PCT} percent this year .",
)


class _Filler:
    """Expands template slots using one random stream and one set of pools."""

    def __init__(self, rng: random.Random, pools: Mapping[str, tuple[str, ...]]):
        self.rng = rng
        self.pools = pools
        # Names already used in the current sentence; avoids "Ajax beat Ajax".
        self.used: set[str] = set()
        self.entity_slots = {
            "PER": ("PER", self.person),
            "PER_LAST": ("PER", lambda: self.pick("LAST")),
            "ORG": ("ORG", self.organisation),
            "COMPANY": ("ORG", lambda: self.pick("COMPANY")),
            "COMPANY_SHORT": ("ORG", lambda: self.pick("COMPANY").split(" ")[0]),
            "INSTITUTION": ("ORG", lambda: self.pick("INSTITUTION")),
            "TEAM": ("ORG", lambda: self.pick("TEAM")),
            "TEAM_CITY": ("ORG", self.team_city),
            "ORG_COMPOSITE": ("ORG", self.org_composite),
            "LOC": ("LOC", self.location),
            "COUNTRY": ("LOC", lambda: self.pick("COUNTRY")),
            "CITY": ("LOC", lambda: self.pick("CITY")),
            "PLACE": ("LOC", lambda: self.pick("PLACE")),
            "MISC": ("MISC", self.misc),
            "NAT": ("MISC", lambda: self.pick("NAT")),
            "EVENT": ("MISC", lambda: self.pick("EVENT")),
            "PRODUCT": ("MISC", lambda: self.pick("PRODUCT")),
            "AWARD": ("MISC", lambda: self.pick("AWARD")),
            "TREATY": ("MISC", lambda: self.pick("TREATY")),
            "LANG": ("MISC", lambda: self.pick("LANG")),
            "RELIGION": ("MISC", lambda: self.pick("RELIGION")),
        }
        self.filler_slots = {
            "NUM": lambda: str(rng.randint(2, 99)),
            "FEW": lambda: str(rng.randint(2, 9)),
            "BIGNUM": self.big_number,
            "PCT": lambda: f"{rng.randint(0, 12)}.{rng.randint(0, 9)}",
            "SCORE": lambda: f"{rng.randint(0, 5)}-{rng.randint(0, 5)}",
            "TIME": self.race_time,
            "YEAR": lambda: str(rng.randint(1988, 2024)),
            "DATE": lambda: (
                f"{rng.randint(1988, 2024)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
            ),
            "DAY": lambda: rng.choice(_DAYS),
            "MONTH": lambda: rng.choice(_MONTHS),
            "TITLE": lambda: rng.choice(_TITLES),
            "SAID": lambda: rng.choice(_SAID),
        }

    def pick(self, pool: str) -> str:
        names = self.pools[pool]
        fresh = [n for n in names if n not in self.used]
        name = self.rng.choice(fresh or names)
        self.used.add(name)
        return name

    def person(self) -> str:
        first, last = self.pick("FIRST"), self.pick("LAST")
        if self.rng.random() < 0.1:
            initial = self.rng.choice("ABCDEFGHJKLMNOPRSTW")
            return f"{first} {initial}. {last}"
        return f"{first} {last}"

    def org_composite(self) -> str:
        # ORG names built around a LOC word, so the model must use the
        # surrounding words, not the place name alone, to pick the type.
        kind = self.rng.randrange(4)
        if kind == 0:
            return f"{self.pick('CITY')} City Council"
        if kind == 1:
            return f"University of {self.pick('CITY')}"
        if kind == 2:
            return f"Bank of {self.pick('COUNTRY')}"
        return f"{self.pick('CITY')} Chamber of Commerce"

    def team_city(self) -> str:
        suffix = self.rng.choice(("United", "Rovers", "Athletic", "City"))
        return f"{self.pick('CITY')} {suffix}"

    def organisation(self) -> str:
        r = self.rng.random()
        if r < 0.4:
            return self.pick("COMPANY")
        if r < 0.65:
            return self.pick("INSTITUTION")
        if r < 0.85:
            return self.pick("TEAM")
        return self.org_composite()

    def location(self) -> str:
        r = self.rng.random()
        if r < 0.4:
            return self.pick("COUNTRY")
        if r < 0.8:
            return self.pick("CITY")
        return self.pick("PLACE")

    def misc(self) -> str:
        r = self.rng.random()
        if r < 0.4:
            return self.pick("NAT")
        if r < 0.65:
            return self.pick("EVENT")
        if r < 0.8:
            return self.pick("PRODUCT")
        if r < 0.9:
            return self.pick("AWARD")
        return self.pick("TREATY")

    def big_number(self) -> str:
        rng = self.rng
        if rng.random() < 0.5:
            return f"{rng.randint(2, 95)},{rng.randint(0, 999):03d}"
        return f"{rng.randint(1, 9)}.{rng.randint(1, 9)} million"

    def race_time(self) -> str:
        rng = self.rng
        if rng.random() < 0.5:
            return f"{rng.randint(9, 10)}.{rng.randint(0, 99):02d}"
        return f"{rng.randint(1, 3)}:{rng.randint(0, 59):02d}.{rng.randint(0, 99):02d}"

    def expand(self, slot: str) -> tuple[str, str | None]:
        """Return the slot's text and its entity type (None for filler)."""
        if slot in self.entity_slots:
            entity_type, make = self.entity_slots[slot]
            return make(), entity_type
        if slot in self.filler_slots:
            return self.filler_slots[slot](), None
        raise KeyError(f"unknown template slot {{{slot}}}")

    def sentence(self, template: str) -> Sentence:
        self.used.clear()
        tokens: list[str] = []
        tags: list[str] = []
        for part in template.split(" "):
            if part.startswith("{") and "}" in part:
                # A slot may carry a literal suffix, e.g. "{NUM}-metre".
                slot, suffix = part[1:].split("}", 1)
                text, entity_type = self.expand(slot)
                words = text.split(" ")
                words[-1] += suffix
                tokens.extend(words)
                if entity_type is None:
                    tags.extend("O" for _ in words)
                else:
                    tags.append(f"B-{entity_type}")
                    tags.extend(f"I-{entity_type}" for _ in words[1:])
            else:
                tokens.append(part)
                tags.append("O")
        return Sentence(tuple(tokens), tuple(tags))


def _generate(n_sentences: int, rng: random.Random, pools: Mapping[str, tuple[str, ...]]) -> list[Sentence]:
    if not isinstance(n_sentences, int) or n_sentences < 0:
        raise ValueError(f"n_sentences must be a non-negative int, got {n_sentences!r}")
    filler = _Filler(rng, pools)
    return [filler.sentence(rng.choice(TEMPLATES)) for _ in range(n_sentences)]


def generate(n_sentences: int, seed: int) -> list[Sentence]:
    """Return ``n_sentences`` synthetic sentences (IOB2 tags), using every name.

    The same ``(n_sentences, seed)`` always gives the same sentences, and a
    shorter run is a prefix of a longer one with the same seed.
    """
    return _generate(n_sentences, random.Random(f"confidant-datagen:{seed}:all"), _FULL_POOLS)


def _train_pools(seed: int) -> dict[str, tuple[str, ...]]:
    """Pools with a seeded ``_HOLDOUT_FRACTION`` of every list removed."""
    rng = random.Random(f"confidant-datagen:{seed}:holdout")
    pools = {}
    for name, _, names in _POOLS:
        n_held = max(1, round(len(names) * _HOLDOUT_FRACTION))
        held = set(rng.sample(names, n_held))
        pools[name] = tuple(n for n in names if n not in held)
    return pools


def write_splits(
    out_dir: str | os.PathLike[str],
    n_train: int = 3000,
    n_dev: int = 500,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``train.txt`` and ``dev.txt`` into ``out_dir`` (created if needed).

    Train draws only from the names that survive a seeded holdout of about
    a fifth of every name list; dev draws from all names with its own
    random stream, so it mixes seen and unseen names.  Returns
    ``(train_path, dev_path)``.
    """
    if n_train < 1 or n_dev < 1:
        raise ValueError(f"n_train and n_dev must be at least 1, got {n_train} and {n_dev}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = _generate(n_train, random.Random(f"confidant-datagen:{seed}:train"), _train_pools(seed))
    dev = _generate(n_dev, random.Random(f"confidant-datagen:{seed}:dev"), _FULL_POOLS)
    train_path, dev_path = out / "train.txt", out / "dev.txt"
    write_conll(train_path, train)
    write_conll(dev_path, dev)
    return train_path, dev_path
