"""How many examples a property test draws: ``examples(n)`` is ``n`` under the ``ci`` profile.

Every count follows the hypothesis profile that ``conftest.py`` loads
(``HYPOTHESIS_PROFILE``), scaled by its ``max_examples`` over ci's 100: ``compat``,
which CI's lowest- and newest-versions jobs load (they check the same properties on
other versions of the dependencies; the main job searches the inputs), draws a fifth;
``dev`` a quarter.
"""

from hypothesis import settings


def examples(n: int) -> int:
    """``n`` examples under the ``ci`` profile, scaled for the profile loaded (at least 1)."""
    return max(1, n * settings.default.max_examples // 100)
