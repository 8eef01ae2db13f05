"""The bottom layer every splitserve process shares: the worker protocol and its validation, block hashing,
sampling parameters, text (tokenizer and detokenizer), the configuration model, logging and process helpers.

It imports no torch and nothing else of splitserve, so the gateway, the operator and the autoscaler can run
from a slim image.
"""
