from hypothesis import given, strategies as st

from voicebus.agents.tokens import split_like_llm


@given(st.text(max_size=300))
def test_pieces_join_back_to_the_text(text):
    assert "".join(split_like_llm(text)) == text


def test_words_carry_their_leading_space_and_long_words_are_split():
    pieces = split_like_llm("Hello world, internationalization!")
    assert pieces[:3] == ["Hello", " world", ","]
    assert pieces[3] == " interna"  # long word cut into word pieces, first one keeps the space
    assert "".join(pieces[3:6]) == " internationalization"
    assert pieces[-1] == "!"


def test_markdown_newlines_stay_with_the_next_piece():
    assert split_like_llm("Intro.\n\n## Title") == ["Intro", ".", "\n\n##", " Title"]
