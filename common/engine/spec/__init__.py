"""Speculative decoding (``--speculative-algorithm``): draft heads, draft trees and their verification."""
