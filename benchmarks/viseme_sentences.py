"""Sentences for the viseme estimator: generated ones to train on, written ones held out.

``benchmarks/train_visemes.py`` trains on :func:`training_sentences`; the tests measure on
:data:`HELD_OUT`, which training refuses to see.
"""

from __future__ import annotations

import random

HELD_OUT = (
    "Five brave pilots flew above the vast valley at dawn.",
    "My mother bought a big blue map for five pounds.",
    "Bob and Pam moved the heavy boxes from the van to the barn.",
    "Every morning Phil makes fresh muffins with plum jam.",
    "The famous violinist performed a beautiful piece of music.",
    "Please pass me the purple pen and the small brown folder.",
    "Victor never believed the fable about the wolf and the sheep.",
    "Maybe we should visit the museum before the film begins.",
    "A puppy followed the farmer past the fence and the maple tree.",
    "Bring the umbrella, for the forecast promises heavy rain by evening.",
)

_WORDS = """
apple about above after again air all almost along always am among an and animal another
answer any appear are area around ask at away back ball bank base be bear beat because bed
been before began begin behind being below best better between big bill bird black blood blow
blue board boat body bone book born both bottom bought box boy bread break bright bring broad
brother brown build burn busy but buy by call came camp can captain car care carry case cat
catch cause cell center chair chance change charge check child choose circle city class clean
clear climb close cloud coast cold color come common company cook copy corn corner could count
country course cover cow cross crowd cry cup current cut dance dark day dead deal dear decide
deep describe desert design develop did die different difficult dinner direct do doctor does dog
dollar done door double down draw dream dress drink drive drop dry during each early earth east
easy eat edge effect egg eight either else end enemy energy enough enter equal even evening ever
every example except excite exercise eye face fact fair fall family famous far farm fast father
favor fear feed feel feet fell felt few field fifteen fight figure fill film final find fine
finger finish fire first fish fit five flat floor flow flower fly follow food foot for force
forest form forward found four free fresh friend from front fruit full fun further gas gather
gave general gentle get gift girl give glad glass go gold good got govern grass great green
grew ground group grow guess guide had hair half hand happen happy hard has hat have he head
hear heart heavy held help her here high hill him his history hold home hope horse hot hour
house how huge human hundred hunt hurry I ice idea if imagine in inch include indeed inside
instead into iron is island it job join joy jump just keep kept kind king kitchen knew know
lady lake land large last late laugh lay lead learn least leave left leg less let letter level
lie life lift light like line lip list listen little live long look lost lot loud love low
machine made magnet main major make man many map mark market mass master match matter may me
mean measure meat meet member men metal method middle might mile milk million mind minute miss
modern moment money month moon more morning most mother motion mountain mouth move much music
must my name nation natural near need never new next nice night nine no noise north nose note
nothing notice now number object observe ocean of off offer office often oil old on once one
only open or order other our out over own page paint pair paper park part pass past path pay
people perhaps period person pick picture piece place plain plan plane plant play please plural
poem point poor position possible pound power press pretty print probable problem produce proper
protect proud prove pull push put queen question quick quiet quite race radio rain raise ran
rather reach read ready real reason receive record red remember repeat reply rest result rich
ride right ring rise river road rock roll room root rope rose round row rub rule run safe said
sail salt same sand sat save saw say school science sea season seat second see seed seem self
sell send sense sentence serve set settle seven several shall shape share sharp she sheep shell
shine ship shoe shop short should shoulder shout show side sight sign silent silver simple since
sing single sister sit six size skin sky sleep slow small smell smile snow so soft soil soldier
some son song soon sound south space speak special speed spell spend spread spring square stand
star start state stay steam steel step stick still stone stood stop store story straight strange
stream street strong student study subject such sudden sugar summer sun supply support sure
surface swim symbol table tail take talk tall teach team teeth tell ten test than thank that
the their them then there these they thick thin thing think third this those though thousand
three through throw thus tie time tiny tire to together told tone too took top total touch
toward town track trade train travel tree trip trouble true try tube turn twenty two type under
until up upon us use usual valley value vary very view village visit voice vowel wait walk wall
want war warm was wash watch water wave way we wear weather week weight well went were west what
wheel when where which while white who whole why wide wife wild will win wind window wing winter
wire wish with woman wonder wood word work world would write wrong yard year yellow yes yet you
young your
""".split()


def training_sentences(count: int, seed: int = 0) -> list[str]:
    """``count`` sentences of 5 to 12 common words, none of them one held out."""
    rng = random.Random(seed)
    held = {s.lower().rstrip(".") for s in HELD_OUT}
    out: list[str] = []
    while len(out) < count:
        words = rng.choices(_WORDS, k=rng.randint(5, 12))
        text = " ".join(words)
        if text in held:
            continue
        mark = rng.choice([".", ".", ".", "?", "!", ","])
        if mark == ",":
            text += ", " + " ".join(rng.choices(_WORDS, k=rng.randint(2, 5)))
            mark = "."
        out.append(text[0].upper() + text[1:] + mark)
    return out
