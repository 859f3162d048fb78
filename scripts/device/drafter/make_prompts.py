"""The drafter proof's prompts, generated (nothing can be downloaded on the device): training prompts from
ten everyday domains and held-out prompts from four other domains, each with templates of its own, so the
held-out topics share neither a subject nor a template with training.

    python3 make_prompts.py OUT_DIR [N_TRAIN] [N_HELDOUT]

Writes OUT_DIR/train_prompts.jsonl and OUT_DIR/heldout_prompts.jsonl: one ``{"id", "messages"}`` per line,
a single user turn each (the responses are written by the target model). Deterministic (seed 2026).
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

TRAIN: dict[str, tuple[list[str], list[str]]] = {
    "cooking": (
        [
            "risotto",
            "banana bread",
            "a vegetable curry",
            "sourdough starter",
            "pad thai",
            "lasagna",
            "French omelette",
            "chicken soup",
            "guacamole",
            "pancakes",
            "roast potatoes",
            "hummus",
            "a lentil stew",
            "apple pie",
            "fried rice",
            "tomato sauce",
            "gnocchi",
            "ratatouille",
            "granola",
            "a quiche",
            "falafel",
            "miso soup",
            "shortbread",
            "paella",
            "chili con carne",
        ],
        [
            "Give me a simple recipe for {s}.",
            "What are the most common mistakes people make with {s}?",
            "How can I make {s} healthier without losing flavour?",
            "Explain step by step how to prepare {s}.",
            "What side dishes go well with {s}?",
            "How long does {s} keep in the fridge, and how should I store it?",
            "I have never cooked {s} before. What should I know first?",
            "Suggest a vegetarian twist on {s}.",
        ],
    ),
    "history": (
        [
            "the fall of the Roman Empire",
            "the printing press",
            "the French Revolution",
            "the Silk Road",
            "the Industrial Revolution",
            "the Renaissance",
            "the Ottoman Empire",
            "the Meiji Restoration",
            "the invention of the telegraph",
            "the Black Death",
            "the Magna Carta",
            "the Aztec Empire",
            "the construction of the Great Wall",
            "the Viking Age",
            "the Cold War",
            "ancient Egyptian writing",
            "the abolition of slavery in Britain",
            "the Hanseatic League",
            "the Mongol Empire",
            "the Reformation",
        ],
        [
            "Summarize the main causes of {s}.",
            "Why was {s} important?",
            "Describe daily life during {s}.",
            "What are three common misconceptions about {s}?",
            "Explain {s} to a twelve-year-old.",
            "Which people played the biggest role in {s}, and why?",
            "What can we learn today from {s}?",
        ],
    ),
    "science": (
        [
            "photosynthesis",
            "plate tectonics",
            "the water cycle",
            "rainbows",
            "vaccines",
            "static electricity",
            "ocean tides",
            "magnets",
            "the greenhouse effect",
            "DNA replication",
            "sound waves",
            "volcanoes",
            "the immune system",
            "batteries",
            "erosion",
            "evaporation",
            "friction",
            "lightning",
            "fermentation",
            "the human heart",
            "clouds",
            "earthquakes",
            "nuclear fusion",
            "antibiotics",
            "the nitrogen cycle",
        ],
        [
            "How does {s} work?",
            "Explain {s} in simple terms.",
            "What is a good experiment to demonstrate {s}?",
            "Why does {s} matter for everyday life?",
            "Write a short quiz with answers about {s}.",
            "What questions do scientists still have about {s}?",
            "Compare {s} with something familiar.",
        ],
    ),
    "health": (
        [
            "getting better sleep",
            "starting to run",
            "drinking enough water",
            "reducing stress",
            "stretching after exercise",
            "eating more vegetables",
            "building a home workout",
            "cutting down on sugar",
            "improving posture at a desk",
            "walking every day",
            "learning to swim",
            "strength training for beginners",
            "keeping a food diary",
            "taking breaks from screens",
            "preparing for a 10k race",
            "eating a balanced breakfast",
        ],
        [
            "Give me practical tips for {s}.",
            "Make a four-week plan for {s}.",
            "What are the benefits of {s}?",
            "What mistakes do beginners make when {s}?",
            "How can I stay motivated when {s}?",
            "Write a short encouraging message for a friend who is {s}.",
        ],
    ),
    "finance": (
        [
            "making a monthly budget",
            "saving for a holiday",
            "paying off a credit card",
            "an emergency fund",
            "compound interest",
            "renting versus buying a home",
            "index funds",
            "splitting bills with roommates",
            "saving for retirement",
            "comparing mobile phone plans",
            "buying a used car",
            "reading a payslip",
            "avoiding impulse purchases",
            "a family's grocery budget",
            "planning for a wedding",
        ],
        [
            "Explain {s} as if I were new to personal finance.",
            "What are the first steps for {s}?",
            "List the pros and cons of {s}.",
            "Give me a worked example of {s} with numbers.",
            "What questions should I ask myself about {s}?",
            "Write a checklist for {s}.",
        ],
    ),
    "home": (
        [
            "growing tomatoes",
            "repotting a houseplant",
            "removing a red wine stain",
            "painting a bedroom",
            "fixing a dripping tap",
            "composting kitchen waste",
            "organising a small closet",
            "keeping basil alive",
            "cleaning an oven",
            "hanging a heavy mirror",
            "planting a herb garden",
            "decluttering a garage",
            "insulating a drafty window",
            "caring for a lawn in summer",
            "building a raised garden bed",
        ],
        [
            "How do I go about {s}?",
            "What tools do I need for {s}?",
            "Give me a step-by-step guide to {s}.",
            "What are common problems with {s} and how do I avoid them?",
            "Is {s} a good weekend project? Why?",
            "Explain {s} to someone who has never done it.",
        ],
    ),
    "writing": (
        [
            "asking my manager for a day off",
            "thanking a teacher",
            "complaining about a late delivery",
            "inviting neighbours to a barbecue",
            "apologising for missing a meeting",
            "welcoming a new colleague",
            "requesting a refund",
            "congratulating a friend on a new job",
            "declining a wedding invitation",
            "asking for a letter of recommendation",
            "reminding a client about an invoice",
            "introducing myself to a new team",
            "cancelling a gym membership",
            "recommending a plumber",
        ],
        [
            "Write a short, polite email about {s}.",
            "Draft a friendly text message about {s}.",
            "Write a formal letter about {s}.",
            "Give me three opening lines for a note about {s}.",
            "Rewrite this idea in a warm tone: {s}.",
        ],
    ),
    "geography": (
        [
            "Iceland",
            "the Amazon rainforest",
            "Japan",
            "the Sahara",
            "New Zealand",
            "the Alps",
            "Canada",
            "the Nile",
            "Patagonia",
            "the Mediterranean Sea",
            "Mongolia",
            "the Great Barrier Reef",
            "Portugal",
            "the Himalayas",
            "Kenya",
            "the Mississippi River",
            "Norway",
            "Peru",
            "Vietnam",
            "Scotland",
        ],
        [
            "Tell me about the climate of {s}.",
            "What makes {s} unique?",
            "Plan a one-week trip to {s}.",
            "What should a first-time visitor to {s} know?",
            "Describe the wildlife of {s}.",
            "How has {s} changed over the last century?",
            "Write a short travel diary entry set in {s}.",
        ],
    ),
    "animals": (
        [
            "octopuses",
            "honeybees",
            "elephants",
            "penguins",
            "wolves",
            "dolphins",
            "owls",
            "ants",
            "koalas",
            "salmon",
            "bats",
            "crows",
            "sea turtles",
            "cheetahs",
            "frogs",
            "whales",
            "parrots",
            "beavers",
        ],
        [
            "What are some surprising facts about {s}?",
            "How do {s} communicate?",
            "Describe the life cycle of {s}.",
            "What threats do {s} face in the wild?",
            "Explain how {s} find food.",
            "Write a short children's story about {s}.",
        ],
    ),
    "careers": (
        [
            "a nurse",
            "a carpenter",
            "a data analyst",
            "a primary school teacher",
            "a pilot",
            "a chef",
            "a librarian",
            "an electrician",
            "a physiotherapist",
            "a graphic designer",
            "a journalist",
            "an architect",
            "a firefighter",
            "a pharmacist",
            "a park ranger",
            "an accountant",
        ],
        [
            "What does a typical day look like for {s}?",
            "What skills do I need to become {s}?",
            "Write a job advertisement for {s}.",
            "What are the hardest parts of working as {s}?",
            "Prepare five interview questions for {s}.",
            "How could someone switch careers to become {s}?",
        ],
    ),
}

HELD_OUT: dict[str, tuple[list[str], list[str]]] = {
    "music": (
        [
            "the violin",
            "jazz improvisation",
            "the blues scale",
            "writing a pop chorus",
            "the piano pedals",
            "Baroque music",
            "learning the drums",
            "choir singing",
            "the history of hip hop",
            "the ukulele",
        ],
        [
            "I am a complete beginner: where should I start with {s}?",
            "What makes {s} sound the way it does?",
            "Describe a practice routine built around {s}.",
        ],
    ),
    "sports": (
        [
            "the offside rule in football",
            "a tennis serve",
            "marathon pacing",
            "chess openings",
            "rock climbing",
            "basketball defence",
            "cycling in the rain",
            "table tennis spin",
            "the rules of cricket",
            "rowing",
        ],
        [
            "Break down {s} for someone watching for the first time.",
            "What do coaches emphasise about {s}?",
            "Tell me a short story about a player struggling with {s}.",
        ],
    ),
    "astronomy": (
        [
            "black holes",
            "the phases of the Moon",
            "Jupiter's moons",
            "meteor showers",
            "the life of a star",
            "exoplanets",
            "the Big Bang",
            "solar eclipses",
            "Saturn's rings",
            "the Milky Way",
        ],
        [
            "Walk me through {s} like a planetarium guide would.",
            "What would an astronaut notice about {s}?",
            "Write a short poem inspired by {s}.",
        ],
    ),
    "mythology": (
        [
            "Odin",
            "the labours of Hercules",
            "the Norse creation myth",
            "Anansi the spider",
            "the phoenix",
            "Pandora's box",
            "the Minotaur",
            "Thor's hammer",
            "the Trojan horse",
            "the story of Icarus",
        ],
        [
            "Retell {s} in a few paragraphs.",
            "What lesson does {s} teach?",
            "How might {s} be retold as a modern film?",
        ],
    ),
}


# Ways of asking that training prompts may end with (the held-out prompts use none of them).
TRAIN_STYLES = [
    "",
    " Keep it short.",
    " Use a numbered list.",
    " Answer for a complete beginner.",
    " Give an example.",
    " Be detailed.",
]


def _prompts(
    domains: dict[str, tuple[list[str], list[str]]], count: int, rng: random.Random, styles: list[str]
) -> list[str]:
    pool = [
        t.format(s=s) + style
        for subjects, templates in domains.values()
        for s, t in itertools.product(subjects, templates)
        for style in styles
    ]
    if count > len(pool):
        raise SystemExit(f"asked for {count} prompts, only {len(pool)} distinct ones")
    rng.shuffle(pool)
    return pool[:count]


def main(argv: list[str]) -> int:
    out = Path(argv[1])
    n_train = int(argv[2]) if len(argv) > 2 else 2400
    n_held = int(argv[3]) if len(argv) > 3 else 120
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(2026)
    train, held = _prompts(TRAIN, n_train, rng, TRAIN_STYLES), _prompts(HELD_OUT, n_held, rng, [""])
    assert not set(train) & set(held)
    for name, prompts, tag in (("train_prompts.jsonl", train, "t"), ("heldout_prompts.jsonl", held, "h")):
        with open(out / name, "w", encoding="utf-8") as fh:
            for i, text in enumerate(prompts):
                fh.write(
                    json.dumps({"id": f"{tag}{i:05d}", "messages": [{"role": "user", "content": text}]})
                    + "\n"
                )
    print(json.dumps({"train": len(train), "heldout": len(held)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
