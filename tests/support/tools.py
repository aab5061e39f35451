"""Two function tools with tight schemas, shared by the real-model tool-calling tests: small
enough for SmolLM2 to finish a call within a few dozen tokens."""

from __future__ import annotations

from typing import Any

TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a city",
                                      "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"], "additionalProperties": False}}},
]
