"""The former name of `hvdx.agreement` (every rank makes the same call on the same layout),
kept so that users' imports keep working."""
from hvdx.agreement import AGREEMENT, RankMismatchError, check_agreement, checks_made, describe_differences

__all__ = ["AGREEMENT", "RankMismatchError", "check_agreement", "checks_made", "describe_differences"]
