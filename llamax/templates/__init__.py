"""Chat templates: render a model's own Jinja template, sandboxed and on a budget.

Needs ``jinja2``, one of llamax's dependencies.

>>> from llamax.templates import ChatTemplate
>>> template = ChatTemplate("{% for m in messages %}{{ m.role }}: {{ m.content }}\\n{% endfor %}")
>>> template.render([{"role": "user", "content": "Hi"}])
'user: Hi\\n'
"""

from .messages import InvalidMessageError, validate_messages
from .template import ChatTemplate, TemplateBudgetError, TemplateError, TemplateSecurityError

__all__ = [
    "ChatTemplate",
    "InvalidMessageError",
    "TemplateBudgetError",
    "TemplateError",
    "TemplateSecurityError",
    "validate_messages",
]
