// The sidebar toggles in the article header open the table of contents (and the page contents)
// at every width. pydata-sphinx-theme and sphinx-book-theme both bind their handlers to the
// first `.primary-toggle` / `.secondary-toggle` of the page, which is a hidden copy in the top
// navigation bar; the visible buttons forward their clicks to it.
document.addEventListener("DOMContentLoaded", () => {
  for (const kind of ["primary-toggle", "secondary-toggle"]) {
    const [bound, ...others] = document.querySelectorAll(`.${kind}`);
    for (const button of others) {
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        button.blur();
        bound.click();
      });
    }
  }
});
