"""Models the project was not designed around, and the check of the plan promise on them."""

from tests.corpus.models import CORPUS, Entry

__all__ = ["CORPUS", "Entry"]
