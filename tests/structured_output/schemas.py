"""Twenty JSON schemas, each with a prompt asking for it: nested objects, arrays, enums,
required fields, bounded numbers, string patterns and formats, $ref, anyOf, nullables.

Free strings are bounded (maxLength), as a real schema for a small model should be: a
135M model asked for an unbounded string may repeat itself until max_tokens.
(xgrammar ignores maxLength on a string with a `format`, so formats here are bounded ones.)"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "maxLength": 40}

SCHEMA_CASES: list[tuple[str, dict[str, Any]]] = [
    (
        "Describe a person as JSON.",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    (
        "Give a famous book as JSON with its title, author, year and genres.",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "author": NAME,
                "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                "genres": {
                    "type": "array",
                    "items": {"enum": ["fiction", "history", "science", "poetry", "drama"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["title", "author", "year", "genres"],
        },
    ),
    (
        "Write a postal address as JSON.",
        {
            "type": "object",
            "properties": {
                "street": NAME,
                "city": NAME,
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"enum": ["US", "FR", "DE", "JP"]},
            },
            "required": ["street", "city", "zip", "country"],
        },
    ),
    (
        "Describe a product in a shop as JSON.",
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 1000},
                "in_stock": {"type": "boolean"},
            },
            "required": ["id", "price", "in_stock"],
        },
    ),
    (
        "What is the weather in Paris? Answer in JSON.",
        {
            "type": "object",
            "properties": {
                "city": NAME,
                "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rain", "snow"]},
            },
            "required": ["city", "temperature_c", "conditions"],
        },
    ),
    (
        "Plan a birthday party and give it as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "date": {"type": "string", "format": "date"},
                "attendees": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 4},
            },
            "required": ["name", "date", "attendees"],
        },
    ),
    (
        "Give a simple pancake recipe as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "ingredients": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "item": NAME,
                            "grams": {"type": "integer", "minimum": 1, "maximum": 1000},
                        },
                        "required": ["item", "grams"],
                    },
                },
            },
            "required": ["name", "ingredients"],
        },
    ),
    (
        "Create a user account as JSON.",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
                "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
                "roles": {
                    "type": "array",
                    "items": {"enum": ["admin", "editor", "viewer"]},
                    "maxItems": 3,
                },
                "active": {"type": "boolean"},
            },
            "required": ["username", "email", "roles", "active"],
        },
    ),
    (
        "Give the color orange as JSON with its RGB values.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "rgb": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 255},
                    "minItems": 3,
                    "maxItems": 3,
                },
            },
            "required": ["name", "rgb"],
        },
    ),
    (
        "Where is Tokyo? Give its coordinates as JSON.",
        {
            "type": "object",
            "properties": {
                "latitude": {"type": "number", "minimum": -90, "maximum": 90},
                "longitude": {"type": "number", "minimum": -180, "maximum": 180},
            },
            "required": ["latitude", "longitude"],
        },
    ),
    (
        "Review the movie Titanic as JSON.",
        {
            "type": "object",
            "properties": {
                "movie": NAME,
                "rating": {"type": "integer", "minimum": 1, "maximum": 5},
                "sentiment": {"enum": ["positive", "negative", "mixed"]},
                "summary": {"type": "string", "maxLength": 80},
            },
            "required": ["movie", "rating", "sentiment", "summary"],
        },
    ),
    (
        "Describe an employee and their manager as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "manager": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "level": {"type": "integer", "minimum": 1, "maximum": 10},
                    },
                    "required": ["name", "level"],
                },
                "skills": {"type": "array", "items": NAME, "maxItems": 3},
            },
            "required": ["name", "manager"],
        },
    ),
    (
        "Write an online order as JSON.",
        {
            "$defs": {
                "line": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z0-9]{4,8}$"},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                    },
                    "required": ["sku", "quantity"],
                }
            },
            "type": "object",
            "properties": {
                "order_id": {"type": "integer", "minimum": 1},
                "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "maxItems": 2},
                "currency": {"const": "USD"},
            },
            "required": ["order_id", "lines", "currency"],
        },
    ),
    (
        "Give a phone contact as JSON.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "phone": {"type": "string", "pattern": "^\\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}$"},
            },
            "required": ["name", "phone"],
        },
    ),
    (
        "Is 'Bonjour, ça va?' a question, and in which language? Answer in JSON.",
        {
            "type": "object",
            "properties": {
                "is_question": {"type": "boolean"},
                "language": {"enum": ["en", "fr", "de"]},
            },
            "required": ["is_question", "language"],
            "additionalProperties": False,
        },
    ),
    (
        "List three countries and their capitals as a JSON array.",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"country": NAME, "capital": NAME},
                "required": ["country", "capital"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    (
        "What is 6 times 7? Answer in JSON.",
        {
            "type": "object",
            "properties": {
                "result": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 20}]}
            },
            "required": ["result"],
        },
    ),
    (
        "Describe a cat as JSON; the nickname may be null.",
        {
            "type": "object",
            "properties": {
                "name": NAME,
                "nickname": {"type": ["string", "null"], "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 30},
            },
            "required": ["name", "nickname", "age"],
        },
    ),
    (
        "Describe a company, its CEO and the CEO's contact as JSON.",
        {
            "type": "object",
            "properties": {
                "company": NAME,
                "ceo": {
                    "type": "object",
                    "properties": {
                        "name": NAME,
                        "contact": {
                            "type": "object",
                            "properties": {
                                "email": {
                                    "type": "string",
                                    "pattern": "^[a-z.]{1,20}@example\\.com$",
                                }
                            },
                            "required": ["email"],
                        },
                    },
                    "required": ["name", "contact"],
                },
            },
            "required": ["company", "ceo"],
        },
    ),
    (
        "What time is it? Answer in JSON.",
        {
            "type": "object",
            "properties": {
                "hour": {"type": "integer", "minimum": 1, "maximum": 12},
                "minute": {"type": "integer", "minimum": 0, "maximum": 59},
                "period": {"enum": ["AM", "PM"]},
            },
            "required": ["hour", "minute", "period"],
            "additionalProperties": False,
        },
    ),
]
