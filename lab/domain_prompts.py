"""A prompt set of a domain make demo's head never trained on: code, JSON, SQL and shell
requests, as a developer would send them (lab/domain_shift.py serves it with capture on).

    python -m lab.domain_prompts [--n 375] [--seed 53] [--out lab/domain_shift_prompts.jsonl]

The prompts are made from templates with varied content (function tasks, code snippets, tables
and columns, records, file names, sizes, dates), chosen by a seeded generator: the same
arguments always write the same file. Every prompt is distinct; the kinds take turns in a
shuffled order, so any contiguous slice (the served requests, the newest held-out ones) holds
all four. One JSON line each: {"prompt": ..., "kind": "code" | "json" | "sql" | "shell"}.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent / "domain_shift_prompts.jsonl"

FUNCS = [
    ("is_palindrome", "s: str", "returns True when s reads the same backwards, ignoring case and spaces"),
    ("flatten", "items: list", "flattens a nested list of any depth into one list"),
    ("chunk", "xs: list, size: int", "splits xs into lists of at most size items"),
    ("word_counts", "text: str", "returns a dict mapping each lowercase word to how often it occurs"),
    ("merge_sorted", "a: list[int], b: list[int]", "merges two sorted lists into one sorted list"),
    ("fib", "n: int", "returns the n-th Fibonacci number iteratively"),
    ("parse_duration", "s: str", "parses strings like '1h30m' or '45s' into a number of seconds"),
    ("dedupe", "items: list", "removes duplicates while keeping the first occurrence's order"),
    ("transpose", "matrix: list[list[int]]", "returns the transpose of a rectangular matrix"),
    ("slugify", "title: str", "turns a title into a lowercase URL slug with hyphens"),
    ("rolling_mean", "xs: list[float], window: int", "returns the moving average over each window"),
    ("group_by", "rows: list[dict], key: str", "groups a list of dicts by the value of key"),
    ("validate_email", "address: str", "checks with a regular expression that address looks like an email"),
    ("binary_search", "xs: list[int], target: int", "returns the index of target in sorted xs or -1"),
    ("roman", "n: int", "converts an integer between 1 and 3999 to a Roman numeral"),
    ("camel_to_snake", "name: str", "converts camelCase names to snake_case"),
    ("primes_below", "n: int", "returns every prime below n with a sieve"),
    ("count_vowels", "s: str", "counts the vowels in s"),
    ("top_k", "counts: dict[str, int], k: int", "returns the k keys with the largest counts"),
    ("retry", "fn, attempts: int", "calls fn until it succeeds, at most attempts times, and re-raises the last error"),
    ("read_csv_sum", "path: str, column: str", "sums one numeric column of a CSV file"),
    ("anagrams", "words: list[str]", "groups words that are anagrams of each other"),
    ("clamp", "x: float, lo: float, hi: float", "limits x to the range lo..hi"),
    ("rle", "s: str", "run-length encodes a string, e.g. 'aaab' -> 'a3b1'"),
    ("deep_get", "d: dict, path: str", "reads a dotted path like 'a.b.c' from nested dicts, None when missing"),
    ("median", "xs: list[float]", "returns the median of a non-empty list"),
    ("lru_cache_dict", "capacity: int", "builds a small LRU cache class with get and put"),
    ("to_base", "n: int, base: int", "writes n in the given base between 2 and 16"),
]

SNIPPETS = [
    ("totals.py", "def total(prices):\n    t = 0\n    for p in prices:\n        t = t + p\n    return t"),
    ("names.py", "def initials(names):\n    out = []\n    for n in names:\n        out.append(n[0].upper())\n    return out"),
    (
        "evens.py",
        "def evens(xs):\n    result = []\n    for x in xs:\n        if x % 2 == 0:\n            result.append(x)\n    return result",
    ),
    ("config.py", "import json\n\ndef load(path):\n    f = open(path)\n    data = json.load(f)\n    return data"),
    ("stats.py", "def average(xs):\n    return sum(xs) / len(xs)"),
    (
        "users.js",
        "function activeUsers(users) {\n  var out = [];\n  for (var i = 0; i < users.length; i++) {\n    if (users[i].active) out.push(users[i].name);\n  }\n  return out;\n}",
    ),
    (
        "grid.py",
        "def neighbours(grid, r, c):\n    cells = []\n    for dr in (-1, 0, 1):\n        for dc in (-1, 0, 1):\n            if dr or dc:\n                cells.append(grid[r + dr][c + dc])\n    return cells",
    ),
    (
        "fetch.py",
        "import requests\n\ndef get_user(uid):\n    r = requests.get('https://api.example.com/users/' + str(uid))\n    return r.json()",
    ),
    (
        "temps.py",
        "def to_fahrenheit(celsius):\n    f = []\n    for c in celsius:\n        f.append(c * 9 / 5 + 32)\n    return f",
    ),
    (
        "inventory.py",
        "class Inventory:\n    def __init__(self):\n        self.items = {}\n\n    def add(self, name, qty):\n        self.items[name] = self.items.get(name, 0) + qty",
    ),
]

EDITS = [
    "Add type hints and a docstring.",
    "Rename the variables to clearer names.",
    "Rewrite it with a comprehension or a built-in where possible.",
    "Add error handling for empty or missing input.",
    "Add logging of the inputs and the result.",
    "Make it raise ValueError on invalid input.",
]

BUGGY = [
    "def last(xs):\n    return xs[len(xs)]",
    "def add_item(item, items=[]):\n    items.append(item)\n    return items",
    "def mean(xs):\n    return sum(xs) / len(xs) - 1",
    "def is_even(n):\n    return n % 2 == 1",
    "def reverse(s):\n    return s[::1]",
    "for i in range(10)\n    print(i)",
    "def count(words):\n    d = {}\n    for w in words:\n        d[w] += 1\n    return d",
    "def factorial(n):\n    if n == 0:\n        return 0\n    return n * factorial(n - 1)",
    "def first_upper(s):\n    return s[0].upper + s[1:]",
    "with open('data.txt') as f:\n    for line in f:\n        print(line.strip)",
]

LANGS = ["Python", "JavaScript", "Go", "Rust", "TypeScript", "Java"]

TABLES = {
    "employees": ["id", "name", "department", "salary", "hire_date"],
    "orders": ["id", "customer_id", "total", "status", "created_at"],
    "customers": ["id", "name", "email", "country", "signup_date"],
    "products": ["id", "name", "category", "price", "stock"],
    "events": ["id", "user_id", "type", "page", "ts"],
    "books": ["id", "title", "author", "year", "rating"],
    "flights": ["id", "origin", "destination", "departure", "price"],
    "students": ["id", "name", "grade", "school", "score"],
    "tickets": ["id", "assignee", "priority", "opened_at", "closed_at"],
    "payments": ["id", "order_id", "amount", "method", "paid_at"],
}

SQL_TASKS = {
    "employees": [
        "returns the {n} highest-paid employees",
        "gives the average salary per department",
        "lists employees hired after {year}",
        "counts employees in each department with more than {n} people",
    ],
    "orders": [
        "returns the total revenue per month",
        "lists orders with status '{status}' from the last {n} days",
        "finds the {n} customers with the most orders",
        "computes the average order total per status",
    ],
    "customers": [
        "counts customers per country, largest first",
        "lists customers who signed up in {year}",
        "finds duplicate email addresses",
        "returns customers whose email ends with '@{domain}'",
    ],
    "products": [
        "lists products with fewer than {n} items in stock",
        "returns the most expensive product in each category",
        "computes the total stock value per category",
        "finds products priced between {n} and {m}",
    ],
    "events": [
        "counts daily active users",
        "returns the {n} most visited pages",
        "finds users with more than {n} events of type 'click'",
        "gives the first event of each user",
    ],
    "books": [
        "returns the best-rated book of each author",
        "lists books published before {year}",
        "counts books per decade",
        "finds authors with at least {n} books",
    ],
    "flights": [
        "returns the cheapest flight from each origin",
        "lists flights to '{city}' departing in {year}",
        "computes the average price per route",
        "finds routes with more than {n} flights",
    ],
    "students": [
        "ranks students by score within each school",
        "returns the average score per grade",
        "lists the top {n} students of grade {grade}",
        "counts students per school scoring above {m}",
    ],
    "tickets": [
        "returns the average time to close per priority",
        "lists open tickets older than {n} days",
        "counts tickets per assignee",
        "finds the assignee who closed the most tickets in {year}",
    ],
    "payments": [
        "sums payments per method",
        "finds orders paid more than once",
        "returns the largest payment of each day",
        "lists payments over {m} made by card",
    ],
}

JOINS = [
    ("orders", "customers", "customer_id = customers.id", "list each customer's name with their number of orders"),
    ("payments", "orders", "order_id = orders.id", "find orders whose payments do not add up to the order total"),
    ("orders", "customers", "customer_id = customers.id", "return the total spent per country"),
    ("events", "customers", "user_id = customers.id", "find customers with no events in the last {n} days"),
    ("payments", "orders", "order_id = orders.id", "list unpaid orders with status '{status}'"),
]

ENTITIES = {
    "user profile": ["id", "username", "email", "created_at", "is_admin"],
    "product": ["sku", "name", "price", "currency", "tags"],
    "blog post": ["id", "title", "author", "published", "tags"],
    "weather reading": ["station", "time", "temperature_c", "humidity", "wind_kph"],
    "invoice": ["number", "customer", "lines", "total", "due_date"],
    "server config": ["host", "port", "tls", "workers", "log_level"],
    "recipe": ["name", "servings", "ingredients", "steps", "minutes"],
    "calendar event": ["title", "start", "end", "location", "attendees"],
    "book": ["isbn", "title", "authors", "year", "pages"],
    "flight booking": ["booking_id", "passenger", "from", "to", "seat"],
}

NAMES = [
    "Alice Martin",
    "Bob Chen",
    "Carla Rossi",
    "David Okafor",
    "Elena Petrova",
    "Farid Haddad",
    "Grace Kim",
    "Hugo Lefebvre",
    "Ines Costa",
    "Jonas Berg",
    "Kenji Sato",
    "Lena Novak",
    "Mateo Garcia",
    "Nora Walsh",
]
CITIES = ["Lisbon", "Toronto", "Nairobi", "Osaka", "Berlin", "Lima", "Oslo", "Austin", "Hanoi", "Dublin", "Cairo", "Perth"]
JOBS = ["nurse", "data analyst", "teacher", "carpenter", "pilot", "chef", "architect", "lawyer", "designer", "engineer"]
STATUSES = ["pending", "shipped", "cancelled", "refunded", "delivered"]
DOMAINS = ["example.com", "mail.org", "corp.net", "school.edu"]

EXTS = ["log", "py", "csv", "json", "tmp", "jpg", "md", "txt", "yaml", "sql"]
DIRS = ["/var/log", "~/projects", "./data", "/tmp/build", "~/Downloads", "./src", "/srv/www", "./backups"]
SHELL_TASKS = [
    "finds every .{ext} file under {dir} modified in the last {n} days",
    "deletes .{ext} files older than {n} days in {dir}",
    "counts the lines of all .{ext} files in {dir}",
    "shows the {n} largest files in {dir}",
    "replaces 'foo' with 'bar' in every .{ext} file under {dir}",
    "prints the {n} most common IP addresses in access.log",
    "renames every .{ext} file in {dir} to lowercase",
    "compresses {dir} into a dated tar.gz archive",
    "watches {dir} and prints each new .{ext} file",
    "prints the disk usage of each folder in {dir}, sorted",
    "kills every process listening on port {port}",
    "finds lines containing 'ERROR' in {dir}/*.{ext} and counts them per file",
    "copies {dir} to a remote host with rsync, skipping .{ext} files",
    "prints the {n}th column of a CSV file, without the header",
    "checks every {n} seconds whether example.com answers and logs failures",
    "lists the environment variables whose names start with '{prefix}'",
]
SHELL_SCRIPTS = [
    "backs up {dir} every night and keeps the last {n} archives",
    "takes a folder as its argument and reports how many files of each extension it holds",
    "rotates {dir}/app.log when it is larger than {n} MB",
    "creates a Python virtual environment, installs requirements.txt and runs the tests",
    "pings a list of hosts from hosts.txt and prints which are down",
    "downloads a list of URLs from urls.txt in parallel, {n} at a time",
    "converts every .{ext} file in {dir} to UTF-8",
    "checks that {n} GB of disk space are free before running a build",
]
COMMANDS = [
    "find {dir} -name '*.{ext}' -mtime +{n} -delete",
    "du -sh {dir}/* | sort -h | tail -n {n}",
    "grep -rn 'TODO' {dir} --include='*.{ext}' | wc -l",
    "awk -F, 'NR>1 {{s+=${n}}} END {{print s}}' data.csv",
    "ps aux --sort=-%mem | head -n {n}",
    "tar -czf backup-$(date +%F).tar.gz {dir}",
    "sed -i 's/localhost/0.0.0.0/g' {dir}/*.{ext}",
    "xargs -P {n} -n 1 curl -sO < urls.txt",
    "lsof -i :{port} -t | xargs kill -9",
    "cut -d: -f1 /etc/passwd | sort | uniq -c | sort -rn | head -n {n}",
    "journalctl -u nginx --since '{n} hours ago' | grep -i error",
    "find {dir} -type f -size +{n}M -exec ls -lh {{}} \\;",
]


def _fill(rng: random.Random, text: str) -> str:
    """A template's placeholders with random values (each drawn whether used or not: stable)."""
    values = {
        "n": rng.choice([3, 5, 7, 10, 14, 20, 30]),
        "m": rng.choice([50, 100, 250, 500, 1000]),
        "year": rng.choice(range(2015, 2026)),
        "status": rng.choice(STATUSES),
        "domain": rng.choice(DOMAINS),
        "city": rng.choice(CITIES),
        "grade": rng.choice(range(6, 13)),
        "ext": rng.choice(EXTS),
        "dir": rng.choice(DIRS),
        "port": rng.choice([3000, 5432, 8000, 8080, 9090]),
        "prefix": rng.choice(["AWS_", "PY", "XDG_", "LC_"]),
    }
    return text.format(**values)


def _record(rng: random.Random) -> dict:
    name = rng.choice(NAMES)
    return {
        "name": name,
        "age": rng.randint(19, 78),
        "city": rng.choice(CITIES),
        "job": rng.choice(JOBS),
        "email": name.split()[0].lower() + "@" + rng.choice(DOMAINS),
    }


def code(rng: random.Random) -> str:
    f, args, desc = rng.choice(FUNCS)
    file, snippet = rng.choice(SNIPPETS)
    pick = rng.randrange(6)
    if pick == 0:
        return f"Write a Python function `{f}({args})` that {desc}. Include a docstring."
    if pick == 1:
        return f"Here is {file}:\n\n{snippet}\n\n{rng.choice(EDITS)} Reply with the full file only."
    if pick == 2:
        return f"Write a {rng.choice(LANGS[1:])} function that {desc}."
    if pick == 3:
        return f"Find the bug in this Python code and fix it:\n\n{rng.choice(BUGGY)}"
    if pick == 4:
        return f"Write pytest unit tests for a function `{f}({args})` that {desc}."
    return f"Explain what this code does, line by line:\n\n{snippet}"


def json_request(rng: random.Random) -> str:
    rec = _record(rng)
    entity, fields = rng.choice(list(ENTITIES.items()))
    pick = rng.randrange(6)
    if pick == 0:
        return (
            f"Convert this to JSON with the keys name, age, city and job: {rec['name']} is a {rec['age']}-year-old "
            f"{rec['job']} living in {rec['city']}."
        )
    if pick == 1:
        return f"Write a JSON object for a {entity} with the fields {', '.join(fields)}. Use realistic values."
    if pick == 2:
        broken = json.dumps(rec).replace('"', "'", 2) if rng.random() < 0.5 else json.dumps(rec)[:-1] + ",}"
        return f"This JSON is invalid. Fix it and return only the corrected JSON:\n\n{broken}"
    if pick == 3:
        return f"Write a JSON Schema for a {entity} object with the properties {', '.join(fields)}; mark {fields[0]} as required."
    if pick == 4:
        doc = json.dumps({"user": rec, "orders": [{"id": rng.randint(100, 999), "total": rng.randint(5, 300)}]}, indent=2)
        return f"Given this JSON:\n\n{doc}\n\nWhat is the value of user.{rng.choice(['city', 'job', 'age'])}, and how many orders are there?"
    rows = [_record(rng) for _ in range(3)]
    csv = "name,age,city\n" + "\n".join(f"{r['name']},{r['age']},{r['city']}" for r in rows)
    return f"Turn this CSV into a JSON array of objects:\n\n{csv}"


def sql(rng: random.Random) -> str:
    table, cols = rng.choice(list(TABLES.items()))
    pick = rng.randrange(5)
    if pick <= 1:
        task = _fill(rng, rng.choice(SQL_TASKS[table]))
        return f"Write a SQL query on the table `{table}` ({', '.join(cols)}) that {task}."
    if pick == 2:
        col = rng.choice(cols[1:])
        query = f"SELECT {col}, COUNT(*) AS n FROM {table} GROUP BY {col} HAVING COUNT(*) > {rng.randint(2, 50)} ORDER BY n DESC;"
        return f"Explain what this SQL query does:\n\n{query}"
    if pick == 3:
        entity, fields = rng.choice(list(ENTITIES.items()))
        dialect = rng.choice(["PostgreSQL", "MySQL", "SQLite"])
        return f"Write a {dialect} CREATE TABLE statement for a {entity} with the columns {', '.join(fields)}, with suitable types and a primary key."
    a, b, on, goal = rng.choice(JOINS)
    return f"Write a SQL query joining `{a}` and `{b}` on {a}.{on} to {_fill(rng, goal)}."


def shell(rng: random.Random) -> str:
    pick = rng.randrange(4)
    if pick == 0:
        return f"Write a bash one-liner that {_fill(rng, rng.choice(SHELL_TASKS))}."
    if pick == 1:
        return f"Explain this shell command, part by part:\n\n{_fill(rng, rng.choice(COMMANDS))}"
    if pick == 2:
        return f"Write a bash script that {_fill(rng, rng.choice(SHELL_SCRIPTS))}. Add comments."
    return f"How do I {_fill(rng, rng.choice(SHELL_TASKS)).replace('finds', 'find', 1)} from the Linux command line?"


KINDS = {"code": code, "json": json_request, "sql": sql, "shell": shell}


def prompts(n: int = 375, seed: int = 53) -> list[dict]:
    """``n`` distinct prompts, the kinds taking turns in shuffled rounds of four."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[dict] = []
    tries = 0
    while len(out) < n:
        order = list(KINDS)
        rng.shuffle(order)
        for kind in order:
            tries += 1
            text = KINDS[kind](rng)
            if text not in seen and len(out) < n:
                seen.add(text)
                out.append({"prompt": text, "kind": kind})
        if tries > 50 * n:
            raise SystemExit(f"only {len(out)} distinct prompts after {tries} tries; add template content")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=375)
    ap.add_argument("--seed", type=int, default=53)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rows = prompts(args.n, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    kinds = {k: sum(r["kind"] == k for r in rows) for k in KINDS}
    print(f"wrote {len(rows)} prompts to {args.out}: {kinds}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
