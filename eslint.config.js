// ESLint for the pages' scripts (rtc_server/static): `make lint` runs it.
import js from "@eslint/js";
import globals from "globals";

export default [
  js.configs.recommended,
  {
    files: ["rtc_server/static/**/*.js"],
    languageOptions: {
      ecmaVersion: 2022,
      sourceType: "module",
      globals: { ...globals.browser },
    },
    rules: {
      "no-unused-vars": ["error", { argsIgnorePattern: "^_", ignoreRestSiblings: true }],
      eqeqeq: ["error", "always"],
      "no-var": "error",
      "prefer-const": "error",
    },
  },
  {
    // Loaded with a plain <script> by other sites' pages: a classic script, not a module.
    files: ["rtc_server/static/embed.js"],
    languageOptions: { sourceType: "script" },
  },
];
