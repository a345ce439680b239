import random

from pd.worker.text.stop import StopChecker


def _run(stop: tuple[str, ...], pieces: list[str]) -> tuple[list[str], bool]:
    checker = StopChecker(stop)
    out: list[str] = []
    for piece in pieces:
        text, stopped = checker.add(piece)
        out.append(text)
        if stopped:
            return out, True
    out.append(checker.flush())
    return out, False


def test_no_stop_strings_pass_through():
    assert _run((), ["a", "b"]) == (["a", "b", ""], False)


def test_stop_inside_one_piece():
    out, stopped = _run(("END",), ["hello ", "wor END ld", "never"])
    assert stopped and out == ["hello ", "wor "]


def test_stop_spanning_pieces():
    checker = StopChecker(("</s>",))
    assert checker.add("hi <") == ("hi ", False)
    assert checker.add("/") == ("", False)
    assert checker.add("s>tail") == ("", True)
    assert checker.matched == "</s>"
    assert checker.add("more") == ("", True)
    assert checker.flush() == ""


def test_partial_prefix_held_then_released():
    checker = StopChecker(("STOP",))
    assert checker.add("go ST") == ("go ", False)
    assert checker.add("O") == ("", False)
    assert checker.add("P!") == ("", True)

    checker = StopChecker(("STOP",))
    assert checker.add("go ST") == ("go ", False)
    assert checker.add("OX") == ("STOX", False)  # can no longer match: released

    checker = StopChecker(("STOP",))
    assert checker.add("a STO") == ("a ", False)
    assert checker.flush() == "STO"  # finished for another reason: the held text is real output


def test_held_text_can_restart_a_match():
    checker = StopChecker(("aab",))
    assert checker.add("a") == ("", False)
    assert checker.add("a") == ("", False)
    assert checker.add("a") == ("a", False)  # "aaa": only the last "aa" can still start "aab"
    assert checker.add("b") == ("", True)


def test_multiple_stop_strings_earliest_wins():
    out, stopped = _run(("world", "lo"), ["hello world"])
    assert stopped and out == ["hel"]

    checker = StopChecker(("\n\n", "User:", "###"))
    assert checker.add("answer ##") == ("answer ", False)
    assert checker.add("x U") == ("##x ", False)
    assert checker.add("ser: hi ###") == ("", True)
    assert checker.matched == "User:"


def test_nested_stop_completing_first_wins():
    # "bc" completes before "abcd" could, so the text is cut there however it is split.
    assert _run(("abcd", "bc"), ["xabcd"]) == (["xa"], True)
    assert _run(("abcd", "bc"), ["xab", "cd"]) == (["x", "a"], True)


def test_streamed_equals_whole_text_cut():
    # Any split of the text into pieces emits the same text as cutting it at the first stop.
    rng = random.Random(0)
    stops = ("abc", "bc", "cda", "dd")  # "abc" and "bc" complete together: "abc" wins
    for _ in range(500):
        text = "".join(rng.choice("abcd ") for _ in range(rng.randrange(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(1, 6))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out, stopped = _run(stops, pieces)
        ends = [text.find(s) + len(s) for s in stops if s in text]
        if ends:
            first_end = min(ends)  # streaming stops when the first stop string completes
            prefix = text[:first_end]
            start = min(prefix.find(s) for s in stops if s in prefix)
            assert stopped and "".join(out) == text[:start], (pieces, out)
        else:
            assert not stopped and "".join(out) == text, (pieces, out)
        # Never show part of a stop string that later completes.
        shown = ""
        for piece in out:
            shown += piece
            assert text.startswith(shown)


def test_stops_completing_together_earliest_start_wins():
    assert _run(("bc", "abc"), ["xab", "c"]) == (["x", ""], True)


def test_include_stop_keeps_the_matched_string_and_nothing_after():
    c = StopChecker(("END",), include_stop=True)
    assert c.add("abc E") == ("abc ", False)
    assert c.add("NDxyz") == ("END", True)
    assert c.matched == "END" and c.add("more") == ("", True)


def test_held_back_suffix_is_the_longest_proper_prefix_of_any_stop_string():
    """The held-back tail against the definition, on random texts over a small alphabet (so
    that prefixes overlap often)."""
    rng = random.Random(0)
    for _ in range(3000):
        stops = tuple("".join(rng.choices("ab c", k=rng.randint(1, 6))) for _ in range(3))
        text = "".join(rng.choices("ab c", k=rng.randint(0, 12)))
        want = max(
            (k for k in range(1, len(text) + 1) for s in stops
             if len(s) > k and s.startswith(text[-k:])),
            default=0,
        )  # fmt: skip
        assert StopChecker(stops)._partial_suffix_len(text) == want, (stops, text)
